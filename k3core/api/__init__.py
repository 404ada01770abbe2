"""The contracts every other room is written against.

The kernel backend interface and its bit-exact contract (``kernels``, ``contract``), the
storage backend interface (``storage``), the expert-cache policy contract (``cache_policy``),
the expert-source interface (``experts``), the plugin spec records and pluggy hookspecs
(``specs``, ``hookspecs``), the error types and exit codes (``errors``) and the strict JSON
reader every file reader shares (``safejson``), the capped read of an untrusted file
(``files``), where every output goes and the one check none may fail (``outputs``, with its
partial files in ``partials`` and new files' mode in ``filemode``), and how bytes are
aligned, rounded and written (``units``).

May import: nothing else of k3core.
"""
