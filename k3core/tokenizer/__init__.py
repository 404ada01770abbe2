"""The Kimi tokenizer on tiktoken, its files, and fitting one for synthetic models.

May import: ``k3core.api``.
"""
