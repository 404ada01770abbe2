"""Test support shipped with k3: the conformance suites and what they are built from.

Plugins import the suites from :mod:`k3.testing` (the stable name); a kernel backend's whole
test file is one subclass of ``KernelConformance`` plus one fixture. Everything the suites
read is generated here on the fly (:mod:`k3core.testing.adversarial`,
:mod:`k3core.testing.synthetic_model`, the cache fixture of
:mod:`k3core.testing.expert_cache_conformance`); only k3's own tests use the outside oracle
(:mod:`k3core.testing.fixtures`).
"""
