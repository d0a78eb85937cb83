"""Every private torch / Lightning name lightning_pipe touches, split by owner, with one failure policy.

* :mod:`lightning_pipe._compat.torch` — torch's private pipelining / checkpoint names (plain-torch core may import it);
  its siblings ``torch_release``, ``shape_inference``, ``trace_api``, ``stage_shapes`` and ``dcp`` hold the larger
  concerns.
* :mod:`lightning_pipe._compat.lightning` — Lightning's private names (only the Lightning adapter imports it).
* :mod:`lightning_pipe._compat.transformers` — transformers' private names (``lightning_pipe.hf``; an optional extra,
  so checked by use, not at import).

Policy: each name is resolved when its module is imported; if this torch / Lightning lacks one, the import fails
with an ``ImportError`` naming the attribute, the installed version and the versions we checked. Nothing is
``None`` and then fails later on first use. ``tests/unit/test_compat.py`` lists what each module needs.
"""
