"""Names every process agrees on: the roles of a node process and the dtypes. No torch:
the router, the CLI and the queue clients read them (codec.py and model/loader.py map the
names to torch's dtypes)."""

ROLES = ("prefill", "decode", "colocated")  # of a node process (Hello.role on the wire)
# Every dtype a tensor may have on the wire (TensorMeta, KVLayout), with its size in bytes.
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int32": 4, "int64": 8, "uint8": 1}
MODEL_DTYPES = ("float32", "bfloat16", "float16")  # what the weights and the KV cache run in
assert set(MODEL_DTYPES) <= set(DTYPE_BYTES)
QUANTIZATION_MODES = ("auto", "none", "int8", "int4")  # --quantization (model/quant.py)
# A node holding a file's weights as int4 blocks says so after its model identity hash
# ("HASH+int4"; dequantized: "HASH"): the router keeps one form per cluster.
WEIGHTS_INT4 = "+int4"
HELD_WEIGHTS = ("", WEIGHTS_INT4[1:])   # what may follow the hash's "+"
