"""The node processes: the shell every role shares (base), the I/O thread (io), the
roles (prefill, decode, colocated) and the KV wire transfer between them."""
