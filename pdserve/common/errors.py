"""Every error code pdserve speaks, once: between its processes (the ``code`` of a
``ProtocolError`` and of the ``Error`` message, docs/protocol.md), and to clients (the
``code`` of an HTTP error body and of an ingress ``error`` answer, with its HTTP status;
docs/http-api.md, docs/queue-protocol.md). A code that means the same on both sides
(``timeout``, ``internal``) is one constant.
"""
# Between processes.
BAD_MESSAGE = "bad_message"
VERSION_MISMATCH = "version_mismatch"
UNKNOWN_TYPE = "unknown_type"
UNEXPECTED_TYPE = "unexpected_type"
TOO_LARGE = "too_large"
LAYOUT_MISMATCH = "layout_mismatch"
MODEL_MISMATCH = "model_mismatch"
CHECKSUM_MISMATCH = "checksum_mismatch"
NO_CAPACITY = "no_capacity"
LEASE_EXPIRED = "lease_expired"
TIMEOUT = "timeout"
ABORTED = "aborted"
INTERNAL = "internal"
UNREACHABLE = "unreachable"  # a peer's address cannot be connected to
NAME_TAKEN = "name_taken"    # Welcome.code: another live connection holds this node id
BAD_GUIDE = "bad_guide"      # a request's structured-output guide failed on the node (400)
# Both ways: a decode node tells a stream's old router that another router's Resume took it
# over; that router ends the producer's request there with it [409].
STREAM_MOVED = "stream_moved"
WIRE_CODES = (BAD_MESSAGE, VERSION_MISMATCH, UNKNOWN_TYPE, UNEXPECTED_TYPE, TOO_LARGE,
              LAYOUT_MISMATCH, MODEL_MISMATCH, CHECKSUM_MISMATCH, NO_CAPACITY,
              LEASE_EXPIRED, TIMEOUT, ABORTED, INTERNAL, UNREACHABLE, NAME_TAKEN, BAD_GUIDE,
              STREAM_MOVED)

# To clients, with the HTTP status in brackets.
BAD_REQUEST = "bad_request"              # [400] the request itself is wrong
NOT_FOUND = "model_not_found"            # [404] unknown model name
OVERLOADED = "overloaded"                # [429] queues full: retry later
NO_NODES = "no_nodes"                    # [503] no live prefill or decode node
NODE_ERROR = "node_error"                # [500] a node failed the request
REQUEST_TOO_LARGE = "request_too_large"  # [413] an HTTP body over the limit
UNAUTHORIZED = "invalid_api_key"         # [401] no or a wrong API key
RESPONSE_NOT_FOUND = "response_not_found"  # [404] no stored response of that id
DUPLICATE_ID = "duplicate_id"            # ingress: the producer's id is in flight already
STREAM_NOT_FOUND = "stream_not_found"    # [404] a resume no decode node holds the stream of
HTTP_STATUS = {BAD_REQUEST: 400, NOT_FOUND: 404, OVERLOADED: 429, NO_NODES: 503,
               TIMEOUT: 504, NODE_ERROR: 500, INTERNAL: 500, REQUEST_TOO_LARGE: 413,
               UNAUTHORIZED: 401, RESPONSE_NOT_FOUND: 404, STREAM_NOT_FOUND: 404,
               STREAM_MOVED: 409}
