"""The Lightning adapter: the only part of lightning_pipe that imports Lightning.

It turns Lightning's hooks (setup, training_step, backward, optimizer_step, checkpoint save/load, precision) into
calls on the plain-torch core (:mod:`lightning_pipe.runtime.engine`, :mod:`lightning_pipe.parallel.grads`,
:mod:`lightning_pipe.checkpoint`).
"""
