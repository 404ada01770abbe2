"""One run, as one pipeline for the CLI, the Python API and a server.

request (``request.py``: what was asked, validated) -> plan (``plan.py``: settings with
their sources, presets, tokenizer, the memory plan, all checked before anything large is
allocated) -> engine (``engine.py`` over ``binding.py``: opened once, reusable) -> session
(``session.py``: a sequence that generates or streams; ``stops.py``, ``state_file.py``) ->
report (``report.py``). ``runner.py`` is ``k3 run`` as one call of it; settings, presets
and prompts have their own modules (outputs are checked and written by
``k3core.api.outputs``, which every room shares).

May import: every room below it (``api``, ``plugins``, ``model``, ``checkpoint``, ``trunk``,
``experts``, ``tokenizer``).
"""
