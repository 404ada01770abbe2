"""Expert parallelism on Ray: routed experts spread over N worker actors, byte-identical.

Each worker (``worker.ExpertWorker``, run as a Ray actor) owns a fixed share of every MoE
layer's routed experts, planned by bytes (``plan``), and serves them from its own storage
backend and expert cache over its own copy (or share) of the checkpoint, checked against
the head's before the first token (``share``). Per MoE layer the head sends each worker the
latent rows routed to its experts, all calls at once, and sums what comes back in the
original order (``executor``), so the logits are those of one node for any N. ``pool``
starts or joins the Ray cluster; ``traffic`` is the real-shape arithmetic of what moves.
Ray is an optional extra: nothing here imports it until a cluster is asked for.
"""
