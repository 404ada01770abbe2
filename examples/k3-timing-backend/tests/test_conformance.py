import pytest
from k3_timing import TimedBackend

from k3.testing import KernelConformance


class TestTimedBackend(KernelConformance):
    @pytest.fixture
    def backend(self):
        return TimedBackend()
