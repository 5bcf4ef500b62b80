"""Check ``optim``: a candidate's distributed optimizer bitwise equal to refgrad.

The candidate (fastgrad by default, Megatron-Core, or a broken one) is reached only through
its optimizer interface (``candidate.optimizer()``,
:class:`~verify.candidates.interfaces.DistributedOptimizerStep`): ``data_parallel`` wraps
the check's model in the candidate's DDP on the check's DP group, ``build`` makes its
distributed optimizer, ``mxfp8`` its MXFP8 params (a candidate without them: a SKIP naming
why). A candidate that documents departures from
``refgrad.optim`` (Megatron-Core: torch.optim.AdamW's order, an fp32 partial-sum grad norm,
the param all-gather launched by the next forward) is held to refgrad's model of each and
the distance from the spec is a documented difference naming where it lives (``compare``);
a candidate whose optimizer cannot share a world (Megatron-Core's ``get_megatron_optimizer``
all-gathers over the default group) gets a world per DP size, the same cases on ranks
``0..DP-1``; what it cannot run (Megatron-Core: SGD, the checkpoint) is a SKIP with the reason.

One spawn of 4 gloo ranks with sub-groups DP=1 (one rank), DP=2 (ranks 0-1 and
2-3), DP=3 (ranks 0-2, padding and uneven ownership) and DP=4 (the world); every
rank gets its own grads; after every step the full params, fp32 masters and
optimizer state (via ``named_state_dict``) must equal ``refgrad.optim`` fed refgrad's
reduction of the same grads, bitwise, and be the same on every rank; every rank's
params after the gather are compared with refgrad's, and every rank's global norm
with refgrad's exact one. The model holds a tied copy of the embedding marked
``shared`` (the norm counts it once).

The case matrix covers every dimension at least once, not the product
(``cases.case_matrix``; DP / algorithm / grads / main grads / clip / gather):

  * DP=1 adamw bf16/fp32 clip sync
  * DP=2 adamw bf16/bf16 clip overlap   (the checkpoint case, 3 steps)
  * DP=2 sgd   fp16/fp16 noclip sync    (loss scaler, hysteresis 1: infs in every shard skip step 2)
  * DP=3 sgd   bf16/fp32 noclip overlap
  * DP=4 adamw fp16/fp16 clip overlap   (loss scaler, hysteresis 2: an inf in one rank's shard)
  * DP=2 adamw bf16/fp32 clip overlap param-loss  (the loss depends on the params)
  * not ``--quick``: DP=3 adamw fp16/fp32 clip sync, DP=4 sgd bf16/bf16 clip sync

so both algorithms meet both grad dtypes, both main-grad dtypes, clipping on and
off and both gather modes; every DP size meets AdamW or SGD with overlap or not. Every
case but the last changes its learning rate and weight decay at every update
(``cases.SCHEDULES``: Megatron-LM's warm-up, then cosine decay; a rising weight decay),
through the seam's ``OptimizerSettings.schedule``; refgrad steps each update with the
schedule's values (a skipped step does not advance it, as Megatron-LM's ``train_step``).
"bf16" params are bf16 beside fp32 ones (two buffer groups); weight decay is off
for biases and norm weights (``param_groups_without_decay_for``). The loss
scaler's state after every step is compared with Megatron-Core's rule derived by
hand. The check's loop reads each step's params through the next forward, their
all-gathers in flight, as training does; a probe at every module's forward start
fails a read of a param whose gather is still in flight. With overlap the ranks
exchange each step's outcome on a bookkeeping group (a skip decided per rank:
the skipping ranks pair the others' gathers with ``publish_params()``, and the
numbers FAIL instead of the ranks hanging); an error the optimizer raises is
recorded and the numbers are still compared. Then:

  * resume: the DP=2 checkpoint after step 2, loaded at DP=2 on other ranks, gives
    step 3 bitwise equal to the uninterrupted run; loaded at DP=3 it gives bitwise
    the same full masters and state, params equal to the masters' cast, and a
    step 3 equal to refgrad;
  * MXFP8 params (``mxfp8``), on ranks 0-1 of the same spawn at DP=2: AdamW (clipped)
    and SGD, buffer sharing off and on (and bf16 grads unless ``--quick``), 3 steps
    of rank-specific grads; after every step the fp32 masters, the optimizer state
    and every rank's MXFP8 scale and element bits bitwise equal to refgrad's step
    on the reduced grads, then ``refgrad.mxfp8.quantize`` of the bf16-rounded
    masters; sharing on must give the same bits as sharing off. Skipped for an
    optimizer without ``supports_mxfp8``;
  * measured, not asserted: ``torch.optim.AdamW`` vs the spec in fp32 ULP. torch
    updates ``m`` with ``lerp_`` (a fused multiply-add on CPU), ``v`` with one
    ``addcmul_``, puts the fp64 bias corrections on the step size and on
    ``sqrt(v)/sqrt(bc2)`` and adds eps after that division, and applies the update
    with one ``addcdiv_``; the spec rounds ``beta1*m + (1-beta1)*g`` term by term,
    divides ``m`` and ``v`` by fp32 bias corrections and adds eps to ``sqrt(v_hat)``.

Cost: refgrad's trajectories (exact arithmetic, pure Python) run in processes of their
own (``spawn`` with one rank), the case matrix's while the 4 ranks train, so that they
do not hold the interpreter lock against the check ``verify run --jobs`` runs beside
this one; MXFP8 runs with bitwise the same inputs (sharing on and off) share one.

Package layout: ``cases`` (the model, data and matrix, shared with the tests),
``expectations`` (refgrad's trajectories and its model of a documented optimizer),
``mxfp8`` (the MXFP8 runs and their refgrad expectations, shared with the tests),
``worker`` (the ranks), ``compare`` (the comparisons and their classification), ``entry``
(the run function, the registration and the report glue).
"""

from verify.checks.optim.entry import CHECK, run

__all__ = ["CHECK", "run"]
