"""Names every process agrees on: the roles of a node process."""

ROLES = ("prefill", "decode", "colocated")  # of a node process (Hello.role on the wire)
