"""Test support shipped with k3: fixture location and the conformance suites.

Third-party plugins reuse these: a kernel backend's whole test file is one subclass of
:class:`k3core.testing.kernel_conformance.KernelConformance` plus one fixture.
"""
