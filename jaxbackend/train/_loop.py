"""The training loop: a char-level language model, AdamW, evaluation, checkpoints.

What is trained, on what: the built-in GPT on the stdlib source by default;
your own model, loss and data through `train(cfg, model=, loss=, data=)` or
`TrainConfig(model="path/to/script.py:build", data="file.txt")` (the CLI's
`--model`/`--data`). A model is an `nnx.Module`, or a factory called as
`build(vocab_size=, seq_len=, rngs=)` that returns one; the loss is
`loss(model, tokens, targets) -> scalar`, by default `model.loss(tokens,
targets)` where the model has one, else the mean next-token cross entropy
of `model(tokens)`'s logits (`models.lm_loss`). Data is a text (encoded as
chars) or a 1-d array of token ids. The checkpoint records which model
and a fingerprint of the data, and a resume must see the same.

State is functional: the model is split once into (graphdef, params,
rest) and `params` is a plain dict (`nnx.to_pure_dict`), so the step is a
pure function `(params, opt_state, data, step) -> (params, opt_state,
loss)` compiled with `jaxbackend.jit`, and a checkpoint is just
`{"params", "opt_state"}` plus JSON metadata, saved with orbax into
`OUT/checkpoints/<step>` (see `_checkpoint`): in the background while the
next steps run, the newest `keep` steps kept. A resume restores each
array onto the sharding the fresh state has, so it may run on another
mesh than the one that saved.
Batches are drawn inside the step from `(seed, step)` (see `_data`), so
`--resume` replays the exact data order. A checkpoint records every setting
(`settings`) so a resume can reuse them; the ones that decide the numbers
(`model_key`, less `steps`) must agree, and `steps` may grow: the learning
rate schedule is then stretched over the new total (so an extended run is
not bitwise the run that had the larger `steps` from the start).

Stopping: `train(..., stop=fn)` calls `fn()` after every step; when it
returns True the loop saves a checkpoint and raises `Stopped` (the CLI sets
it from SIGTERM and a first Ctrl-C). A flag polled between steps, not an
exception raised from the signal handler: an exception could land between
a donating step call and the assignment of its results, leaving nothing
valid to save.

Multi-device (`devices > 1`): a 1-d mesh `data`; the step is compiled with
`jb.jit(mesh=)`, so the sharding search plans the whole step, and the
parameters, the data and the optimizer state are placed by that plan
(`_shard`).

`stack_layers` (`--stack-layers`): the params (so the optimizer state and
the checkpoint) keep the L blocks' weights as stacked arrays
(`jb.stack_layers`), and the model's for-loop runs as written: a rolled step
then takes and returns a few arrays instead of one per layer and weight,
which is most of the trace and XLA compile time of a deep model
(BENCHMARKS.md). None (the default) stacks where the step is rolled: a list
of at least `passes.REROLL_MIN_REPEATS` identical layers; shallower models
keep per-layer arrays (unrolled, stacked weights would only add a slice per
layer and weight). The optimizer (AdamW, global-norm clip) treats every
element alike, so both layouts compute the same numbers. It changes the
checkpoint's layout, so a resume keeps the recorded choice.

`train` runs five stages over one `_Run` record: `_setup` (checks, corpus,
model, optimizer), `_shard.place` (devices > 1), `_resume` (optimizer state, from
the checkpoint on --resume), `_loop` (steps, evaluations, checkpoints) and
`_finish` (final loss, sample, plot, the result dict). Progress is a
`rich` bar on a terminal and plain lines elsewhere (`_progress`); every
step and evaluation also goes to `OUT/metrics.jsonl`.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxbackend import nn
from jaxbackend._stacked import unstack_layers
from jaxbackend.jit import jit
from jaxbackend.models import GPT, GPTConfig, generate
from jaxbackend.train import _checkpoint, _data, _model, _plots, _shard
from jaxbackend.train._progress import Progress, metrics_log

CKPT_NAME = "checkpoints"   # the orbax folder: one sub-folder per kept step
METRICS_NAME = "metrics.jsonl"   # one JSON object per step and per evaluation
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
JIT_NAME = "jaxbackend.jit"   # what `train`'s result and log report as the compiler


class Stopped(Exception):
    """`train(stop=...)` asked the run to end; the checkpoint is saved."""

    def __init__(self, step: int, ckpt: pathlib.Path):
        super().__init__(f"stopped at step {step}; checkpoint -> {ckpt}")
        self.step, self.ckpt = step, ckpt


@dataclasses.dataclass
class TrainConfig:
    steps: int = 250
    batch: int = 32
    seq: int = 64
    layers: int = 2
    embd: int = 128
    heads: int = 4
    lr: float = 3e-3
    seed: int = 0
    out: str = "runs/train"
    ckpt_every: int = 100
    eval_every: int = 100
    resume: bool = False
    devices: int = 1
    max_chars: int = 2_000_000
    eval_batches: int = 8
    sample_chars: int = 300
    weight_decay: float = 0.1
    warmup: int = 30
    quiet: bool = False
    data: str | None = None    # a text file to train on; None: the stdlib source
    model: str | None = None   # "path/to/script.py:build", a model factory; None: the GPT
    dtype: str = "float32"     # the GPT's compute dtype; parameters stay float32
    accum: int = 1             # micro-batches of `batch` averaged per optimizer step
    clip: float = 1.0          # gradient global-norm clip, 0 = none
    keep: int = 3              # checkpoints kept: the newest `keep` steps
    # params hold the blocks' weights stacked (`jb.stack_layers`); None: where
    # the model has >= passes.REROLL_MIN_REPEATS identical layers (docstring)
    stack_layers: bool | None = None

    def model_config(self) -> GPTConfig:
        return GPTConfig(vocab_size=_data.VOCAB, seq_len=self.seq, n_layers=self.layers,
                         embd=self.embd, heads=self.heads)

    def compute_dtype(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is not one of {', '.join(DTYPES)}; pick one.")
        return DTYPES[self.dtype]

    def model_key(self) -> dict:
        """The settings a checkpoint must agree on to be resumed (`steps` may
        grow); `train` adds which model and a checksum of the data."""
        return dict(batch=self.batch, seq=self.seq, layers=self.layers, embd=self.embd,
                    heads=self.heads, lr=self.lr, seed=self.seed, steps=self.steps,
                    max_chars=self.max_chars, warmup=self.warmup, weight_decay=self.weight_decay,
                    dtype=self.dtype, accum=self.accum, clip=self.clip,
                    stack_layers=self.stack_layers)

    def settings(self) -> dict:
        """Every field a resume may reuse (not where the run lives or how it prints)."""
        skip = ("out", "resume", "quiet")
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in skip}


@dataclasses.dataclass
class _Run:
    """What the stages of `train` share. `_setup` builds it; `_shard.place`
    places `params` and `data` by the compiled step's plan;
    `_resume` sets `opt_state` and where the run starts; `_loop` advances
    `params`, `opt_state` and the histories."""

    cfg: TrainConfig
    ckpt: pathlib.Path
    say: Callable[[str], None]
    identity: dict                  # what a resume must agree on (`_checkpoint.check_resumable`)
    source: str                     # what the data is, for the log
    schedule: Callable              # step -> learning rate
    model: nnx.Module
    pstate: nnx.State               # the parameters' dims metadata, for sharding specs
    params: dict
    loss_fn: Callable
    tx: optax.GradientTransformation
    ids: np.ndarray
    train_ids: np.ndarray
    val_ids: np.ndarray
    baseline: float
    data: jax.Array
    eval_fn: Callable
    val_batches: list
    opt_shardings: object = None    # the optimizer state's layout by the plan (`_shard`)
    plan_s: float = 0.0             # seconds the sharding plan took, before the first step
    opt_state: object = None
    start: int = 0
    history: list = dataclasses.field(default_factory=list)
    val_history: list = dataclasses.field(default_factory=list)

    def evaluate(self) -> float:
        """Mean validation loss of the current parameters."""
        return float(np.mean([float(self.eval_fn(self.params, x, y)) for x, y in self.val_batches]))


def train(cfg: TrainConfig, log=print, on_step=None, stop=None, *, model=None, loss=None,
          data=None) -> dict:
    """Run (or resume) training; returns losses, timings and paths.

    `model`: an `nnx.Module` or a factory `build(vocab_size=, seq_len=,
    rngs=)` (default: `cfg.model`, else the GPT of `cfg`). `loss(model,
    tokens, targets)`: default the model's `loss` method, else cross entropy
    of its logits. `data`: a text or 1-d token ids (default: `cfg.data`, else
    the stdlib source). `on_step(step, history, val_history)` is called after
    every step (a notebook redraws its live loss plot from it). `stop()`,
    polled after every step, True: save a checkpoint and raise `Stopped`."""
    run = _setup(cfg, log, model, loss, data)
    step_fn = _step_fn(run, _shard.make_mesh(cfg) if cfg.devices > 1 else None)
    if cfg.devices > 1:
        _shard.place(run, step_fn)
    _resume(run)
    with Progress(cfg.steps, run.start, cfg.quiet) as bar, \
            _checkpoint.Checkpointer(run.ckpt, cfg.keep) as saver:
        # Leaving the block (done, stopped or failed) waits for the last save.
        elapsed, t_compile = _loop(run, step_fn, bar, saver, on_step, stop)
    return _finish(run, elapsed, t_compile)


def _setup(cfg: TrainConfig, say, model, loss, data) -> _Run:
    """Loads the data, builds the model, checks a resume can work (before
    anything compiles) and builds the optimizer."""
    ckpt = pathlib.Path(cfg.out) / CKPT_NAME
    if cfg.keep < 1:
        raise ValueError(f"keep={cfg.keep} would delete every checkpoint; keep at least 1.")
    # one process deletes (every process of a run sees the same folder)
    for tmp in _checkpoint.remove_stale_tmp(ckpt) if jax.process_index() == 0 else ():
        say(f"removed {tmp} (left by a run killed while saving)")
    if cfg.resume:  # fail fast on a missing or unreadable checkpoint
        _checkpoint.read_meta(ckpt)
    ids, source = _data.load(data, cfg.data, cfg.max_chars)
    train_ids, val_ids = _data.split(ids)
    model, model_name = _model.build(cfg, model, _data.vocab_size(ids))
    params, loss_fn = nn.functional(model, _model.loss_of(model, loss))
    params, stacked = _model.arrange(cfg, params, model_name, ckpt)
    cfg = dataclasses.replace(cfg, stack_layers=stacked)   # the checkpoint records the choice
    identity = {**cfg.model_key(), "model": model_name, "data": _data.fingerprint(ids)}
    if cfg.resume:
        _checkpoint.check_resumable(ckpt, identity)
    warmup = min(cfg.warmup, cfg.steps - 1)  # optax needs a non-empty cosine phase
    schedule = optax.warmup_cosine_decay_schedule(0.0, cfg.lr, warmup, max(cfg.steps, warmup + 1),
                                                  cfg.lr * 0.1)
    adamw = optax.adamw(schedule, b1=0.9, b2=0.99, weight_decay=cfg.weight_decay)
    tx = optax.chain(optax.clip_by_global_norm(cfg.clip), adamw) if cfg.clip else adamw
    return _Run(cfg=cfg, ckpt=ckpt, say=say, identity=identity, source=source, schedule=schedule,
                model=model,
                pstate=nnx.state(model, nnx.Param),
                params=params, loss_fn=loss_fn, tx=tx, ids=ids, train_ids=train_ids,
                val_ids=val_ids, baseline=_data.unigram_baseline(train_ids, val_ids),
                data=jnp.asarray(train_ids), eval_fn=jit(loss_fn),
                val_batches=_data.eval_batches(val_ids, cfg.batch, cfg.seq, cfg.eval_batches))


def _resume(run: _Run) -> None:
    """A fresh optimizer state, or the checkpoint's state and histories
    (placed like the fresh state)."""
    run.opt_state = (run.tx.init(run.params) if run.opt_shardings is None else
                     jax.jit(run.tx.init, out_shardings=run.opt_shardings)(run.params))
    if run.cfg.resume:
        # Each process reads the shards the fresh state's shardings place on
        # its devices: the mesh may differ from the one that saved.
        state, meta = _checkpoint.load(run.ckpt, {"params": run.params, "opt_state": run.opt_state})
        run.params, run.opt_state = state["params"], state["opt_state"]
        run.start, run.history, run.val_history = meta["step"], meta["history"], meta["val_history"]
        run.say(f"resumed from {run.ckpt / str(run.start)} at step {run.start}")


def _step_fn(run: _Run, mesh=None):
    """The compiled training step (sharded by its searched plan on `mesh`);
    it donates the parameters and the optimizer state."""
    cfg, loss_fn, tx = run.cfg, run.loss_fn, run.tx

    def loss_and_grads(params, data, batch_index):
        x, y = _data.get_batch(data, cfg.seed, batch_index, cfg.batch, cfg.seq)
        return jax.value_and_grad(loss_fn)(params, x, y)

    def train_step(params, opt_state, data, step):
        if cfg.accum == 1:
            loss, grads = loss_and_grads(params, data, step)
        else:  # the mean over micro-batches step*accum .. step*accum + accum-1
            def micro(total, i):
                return jax.tree.map(jnp.add, total,
                                    loss_and_grads(params, data, step * cfg.accum + i)), None
            zero = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
            total, _ = jax.lax.scan(micro, zero, jnp.arange(cfg.accum))
            loss, grads = jax.tree.map(lambda t: t / cfg.accum, total)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, (loss, optax.tree.norm(grads))

    return jit(train_step, donate_argnums=(0, 1), mesh=mesh)


def _loop(run: _Run, step_fn, bar: Progress, saver: _checkpoint.Checkpointer, on_step,
          stop) -> tuple:
    """Steps from `run.start` to `cfg.steps`, evaluating and checkpointing on
    schedule; returns (elapsed seconds, seconds of the first step)."""
    cfg, say = run.cfg, run.say
    shape = (f"{cfg.layers} layers, embd {cfg.embd}, {cfg.heads} heads"
             if isinstance(run.model, GPT) else run.identity["model"])
    say(f"corpus: {len(run.ids):,} tokens of {run.source} ({len(run.train_ids):,} train / "
        f"{len(run.val_ids):,} val); model: {shape}, "
        f"{sum(np.size(p) for p in jax.tree.leaves(run.params)):,} params"
        f"{' (layers stacked)' if cfg.stack_layers else ''}; compiled with {JIT_NAME}")
    say(f"unigram baseline (val cross entropy of char frequencies): {run.baseline:.4f} nats/char")
    tokens = cfg.batch * cfg.seq * cfg.accum
    metrics = metrics_log(pathlib.Path(cfg.out) / METRICS_NAME, run.start)
    t_start = t_last = time.perf_counter()
    t_compile = None
    for step in range(run.start, cfg.steps):
        run.params, run.opt_state, (loss, gnorm) = step_fn(run.params, run.opt_state, run.data,
                                                           jnp.int32(step))
        loss = float(loss)
        if not math.isfinite(loss):
            raise FloatingPointError(f"loss became {loss} at step {step + 1}; lower --lr.")
        now = time.perf_counter()
        if t_compile is None:
            t_compile = now - t_last
        tok_s = tokens / max(now - t_last, 1e-9)
        t_last = now
        run.history.append(loss)
        bar.update(step + 1, loss, tok_s)
        done = step + 1
        metrics(step=done, loss=loss, lr=float(run.schedule(step)), grad_norm=float(gnorm),
                tok_s=round(tok_s, 1))
        if cfg.eval_every and (done % cfg.eval_every == 0) and done != cfg.steps:
            run.val_history.append((done, run.evaluate()))
            metrics(step=done, val_loss=run.val_history[-1][1])
        stopping = stop is not None and stop()
        if done == cfg.steps or (cfg.ckpt_every and done % cfg.ckpt_every == 0) or stopping:
            if done == cfg.steps:
                run.val_history.append((done, run.evaluate()))
                metrics(step=done, val_loss=run.val_history[-1][1])
            _save(run, saver, done)
        if on_step is not None:
            on_step(done, run.history, run.val_history)
        if stopping:
            raise Stopped(done, run.ckpt / str(done))
    return time.perf_counter() - t_start, t_compile


def _save(run: _Run, saver: _checkpoint.Checkpointer, done: int) -> None:
    """Starts the save (after the previous one is on disk); the files are
    written while the next steps run."""
    meta = dict(step=done, config=run.identity, settings=run.cfg.settings(),
                history=run.history, val_history=run.val_history)
    where = saver.save(done, {"params": run.params, "opt_state": run.opt_state}, meta)
    run.say(f"checkpoint step {done} -> {where}")


def _finish(run: _Run, elapsed: float, t_compile) -> dict:
    """Final validation loss against the baseline, a sample from the trained
    model, the loss curve; the result dict of `train`."""
    cfg, say = run.cfg, run.say
    run_steps = cfg.steps - run.start
    if not run.val_history:
        run.val_history.append((cfg.steps, run.evaluate()))
    val, baseline = run.val_history[-1][1], run.baseline
    say(f"val loss {val:.4f} nats/char vs unigram baseline {baseline:.4f} "
        f"({'below' if val < baseline else 'NOT below'} by {baseline - val:.3f})")
    nnx.replace_by_pure_dict(run.pstate, jax.device_get(unstack_layers(run.params)))
    nnx.update(run.model, run.pstate)
    sample = ""
    if cfg.sample_chars:
        prompt = run.val_ids[: cfg.seq // 2].tolist()
        sample = _data.decode(generate(run.model, prompt, cfg.sample_chars,
                                       key=jax.random.key(cfg.seed), seq_len=cfg.seq))
        say("sample (prompt from the validation text, then generated):\n" +
            _data.decode(prompt) + sample)
    png = _plots.loss_curve(pathlib.Path(cfg.out) / "loss.png", run.history, run.val_history,
                            baseline)
    say(f"loss curve -> {png}")
    tokens = cfg.batch * cfg.seq * cfg.accum
    return dict(history=run.history, val_history=run.val_history, val=val, baseline=baseline,
                elapsed=elapsed, steps_run=run_steps,
                compile_s=None if t_compile is None else run.plan_s + t_compile,
                tok_s=tokens * max(run_steps - 1, 1) / max(elapsed - (t_compile or 0), 1e-9),
                sample=sample, png=png, ckpt=run.ckpt, jit=JIT_NAME, params=run.params)
