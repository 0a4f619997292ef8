"""Generation throughput: the KV-cache path vs the full-window path.

The same GPT, prompt and key, sampled two ways in one run by
`jaxbackend.models.generate`: `cache=False` re-runs the model over the whole
(right-padded) seq_len window for every token; `cache=True` fills a
key/value cache with one call over the prompt window, then runs one position
per token. Both must give the same tokens (checked every run).

Timing: each path is called once to compile (reported as "first call"),
then `--repeat` runs of a whole `generate` call (prompt to last token, the
tokens on the host), the two paths interleaved so machine load hits both
alike; reported: the median run as new tokens/s and the speedup. The second
row runs past seq_len, where the cached path refills its cache from the last
seq_len tokens for every token (the window slides, so every position
moves): there both paths cost about one window per token. `--quick` is a
smoke run at tiny sizes and does not write BENCHMARKS.md.

Run: python benchmarks/generate.py [--quick] [--repeat N]
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from benchmarks import _report  # noqa: E402
from jaxbackend.models import GPT, GPTConfig, generate  # noqa: E402


def _timed(model, prompt, steps, cache):
    t0 = time.perf_counter()
    out = generate(model, prompt, steps, key=jax.random.key(0), cache=cache)
    return time.perf_counter() - t0, out


def measure(model, prompt, steps, repeat):
    """(first-call seconds, median seconds) per path, full window first."""
    first = {}
    for cache in (False, True):
        first[cache], out = _timed(model, prompt, steps, cache)
        if cache and out != ref:
            raise AssertionError("the cached path sampled other tokens than the full window")
        ref = out
    runs: dict = {False: [], True: []}
    for _ in range(repeat):
        for cache in (False, True):
            dt, out = _timed(model, prompt, steps, cache)
            if out != ref:
                raise AssertionError(f"generate(cache={cache}) changed its tokens between runs")
            runs[cache].append(dt)
    return {c: (first[c], statistics.median(runs[c])) for c in (False, True)}


def per_token_compute(model, repeat):
    """Milliseconds of one full-window forward and of one cached step, each a
    warm `jax.jit` call over the split model (public `GPT.__call__` and
    `GPT.decode`): what a token costs without `generate`'s dispatch."""
    n = model.config.seq_len
    model.eval()
    graphdef, state = nnx.split(model)
    window = jax.jit(lambda s, w: nnx.merge(graphdef, s)(w).values)
    step = jax.jit(lambda s, t, c, p: nnx.merge(graphdef, s).decode(t, c, p))
    tokens = jnp.zeros((1, n), jnp.int32)
    _, cache = step(state, tokens, model.init_cache(1), 0)
    tok = tokens[:, :1]
    jax.block_until_ready((window(state, tokens), step(state, tok, cache, n // 2)))  # compile
    t_window = _report.median_time(lambda: jax.block_until_ready(window(state, tokens)),
                                   repeat=repeat, number=5)
    t_step = _report.median_time(lambda: jax.block_until_ready(step(state, tok, cache, n // 2)),
                                 repeat=repeat, number=20)
    model.train()
    return t_window * 1e3, t_step * 1e3


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes; does not write BENCHMARKS.md")
    ap.add_argument("--repeat", type=int, default=5, help="timed runs per path (default 5)")
    args = ap.parse_args(argv)
    if args.quick:
        cfg = GPTConfig(vocab_size=64, seq_len=32, n_layers=2, embd=32, heads=4)
        prompt_len, cases, repeat = 4, (20, 40), 2
    else:
        cfg = GPTConfig(vocab_size=128, seq_len=256, n_layers=4, embd=128, heads=4)
        prompt_len, cases, repeat = 16, (200, 300), args.repeat
    model = GPT(cfg, rngs=nnx.Rngs(0))
    prompt = [(7 * i + 1) % cfg.vocab_size for i in range(prompt_len)]
    rows = []
    for steps in cases:
        r = measure(model, prompt, steps, repeat)
        (f_full, t_full), (f_cache, t_cache) = r[False], r[True]
        past = max(0, prompt_len + steps - cfg.seq_len)
        rows.append([f"{prompt_len} + {steps}" + (f" ({past} past seq_len)" if past else ""),
                     f"{steps / t_full:.1f}", f"{steps / t_cache:.1f}", f"{t_full / t_cache:.2f}x",
                     f"{f_full:.2f}", f"{f_cache:.2f}"])
    body = (f"GPT: {cfg.n_layers} layers, embd {cfg.embd}, {cfg.heads} heads, seq_len "
            f"{cfg.seq_len}, vocab {cfg.vocab_size}, float32, batch 1, temperature 1. Median of "
            f"{repeat} runs of one whole `generate` call per path, the paths interleaved; "
            "tokens/s counts new tokens. Same tokens from both paths in every run (checked). "
            "First call: the first `generate` call of the process per path, compile "
            "included.\n\n"
            + _report.table(["prompt + new tokens", "full window tok/s", "KV cache tok/s",
                             "speedup", "full window first call s", "KV cache first call s"],
                            rows)
            + "\n\n- Past seq_len the window slides and every position moves, so the cache "
              "is refilled per token (one window each, as the full-window path).")
    ms_window, ms_step = per_token_compute(model, repeat)
    body += (f"\n- Per-token compute without `generate`'s dispatch (warm `jax.jit` over the "
             f"split model, median): one {cfg.seq_len}-position window forward "
             f"{ms_window:.2f} ms, one cached step {ms_step:.3f} ms "
             f"({ms_window / ms_step:.1f}x). The full-window path dispatches through `nnx.jit`, "
             "which walks the module graph on every call; the cached path passes the split "
             "state's leaves to `jax.jit`.")
    print(body)
    if not args.quick:
        dev = jax.devices()[0].platform
        _report.write_section(f"generate-{dev}", f"Generation: KV cache vs full window ({dev})",
                              body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
