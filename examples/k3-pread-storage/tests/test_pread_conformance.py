"""The whole test file: the shipped storage suite, through the registry (so the registration
is tested too)."""

from k3.testing import StorageConformance


class TestPreadStorage(StorageConformance):
    storage_name = "pread"
