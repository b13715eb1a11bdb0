"""The test suite, a package: test modules, the fault harness and the benchmarks import the
shared helpers by their package path (``tests.helpers``, ``tests.pipeline``,
``tests.builders``, ``tests.faults``, ...), never by a bare name that only resolves while
something has put this folder on ``sys.path`` (and would load a second copy of the module,
its state held twice). ``tests/house/test_layout.py`` checks it.

Test files live in one folder per area of the package, named after its rooms (``kafka/``,
``schemas/``, ``agent_loop/``, ``inference/``, ``replica/``, ``sessions/``, ``assembly/``,
``gateway/``, ``producers/``, ``consumers/``, ``training/``, ``monitoring/``,
``verl_compat/``), plus
``cli/`` (the command line and the end-to-end job), ``house/`` (layout, code size, public
API, markers), ``contract/`` (vLLM's own protocol) and ``faults/`` (the fault rows, beside
the fault-injection harness they use, one module per job). Other folders: ``plugins/`` (agent
loops, tools, reward functions and a vLLM logits processor that the processes under test
load by module name, as a user's own code: that folder, not this one, goes on their
``PYTHONPATH``), ``programs/`` (scripts the tests run in a subprocess, some in a side
environment), ``data/`` (frozen records and verl's config files). Fixtures used by several
areas are in ``conftest.py`` here, those of one area in that area's ``conftest.py``.
"""
