"""Measurement rigs behind the ``tiered-kv`` measuring commands; above the simulator and the engine, under the CLI.

* the crossover fit (:mod:`~tiered_kv.bench.crossover`): swap against
  recompute, measured on a small real model, on a Llama-shaped model with
  random weights, or for a model profile; one step-model fit, written as a
  calibration.  Its parts: the model (:mod:`~tiered_kv.bench.model`), the
  tiers and swap timer (:mod:`~tiered_kv.bench.swap_timer`), the device sync and
  timing helpers (:mod:`~tiered_kv.bench.timing`);
* the GPU rig (:mod:`~tiered_kv.bench.gpu_check`): device facts, the
  gpu-marked tests, copy bandwidth, overlap and syncs, crossover, and the
  report that is valid after every step;
* the copy-engine bandwidth table (:mod:`~tiered_kv.bench.transfer`).

Nothing below this package imports it; the command modules in
:mod:`tiered_kv.cli` import it lazily, once their flags are checked.
"""
