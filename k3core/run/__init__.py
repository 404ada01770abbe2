"""One run: settings and presets, the memory plan, the engine, prompts, the report, outputs.

May import: every room below it (``api``, ``plugins``, ``model``, ``checkpoint``, ``trunk``,
``experts``, ``tokenizer``).
"""
