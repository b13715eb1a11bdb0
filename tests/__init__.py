"""The test suite, a package: test modules, the fault harness and the benchmarks import the
shared helpers by their package path (``tests.helpers``, ``tests.pipeline``,
``tests.builders``, ``tests.faults``, ...), never by a bare name that only resolves while
something has put this folder on ``sys.path`` (and would load a second copy of the module,
its state held twice). ``tests/test_layout.py`` checks it.

Folders: ``faults/`` (the fault-injection harness, one module per job), ``plugins/`` (agent
loops, tools, reward functions and a vLLM logits processor that the processes under test
load by module name, as a user's own code: that folder, not this one, goes on their
``PYTHONPATH``), ``programs/`` (scripts the tests run in a subprocess, some in a side
environment), ``data/`` (frozen records and verl's config files); pytest fixtures live in
``conftest.py``.
"""
