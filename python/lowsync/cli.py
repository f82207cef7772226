"""The `lowsync` command line: `lowsync run` and `lowsync chat` (text in, text out), `lowsync
bench` (the main job) and `lowsync batched-bench`.

`lowsync run -m FILE -p TEXT` continues a prompt and `lowsync chat -m FILE` holds a conversation
with the model's chat template; both stream text to stdout as it is generated and report, on
stderr (so stdout stays the model's text alone, fit for a pipe), the generated tokens, tokens/s
and host waits per token. They are thin shells over `lowsync.LLM`.

`lowsync bench` decodes a prompt and generates tokens with a model (the built-in "tiny" unless
`-m FILE.gguf`) on every usable backend under every sync policy and prints one row per pair as
it finishes: prompt and generation tokens/s and, per generated token, host waits, driver syncs,
elided syncs, submits, empty submits, H2D and D2H copies and reallocations. Stopped by Ctrl-C or
`--timeout`, it keeps (and with `--json` prints) the rows finished so far. `lowsync
batched-bench` mirrors llama-batched-bench (`-npp`, `-ntg`, `-npl`, `-pps`) and fails when a
run reallocates.

By default the bench runs every available backend except those that would read as nonsense or
take minutes next to the others: `noop` (runs no kernel) and Vulkan devices of CPU type (a
software rasteriser such as lavapipe). Either runs when named with `--backend`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import math
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from types import FrameType
from typing import TYPE_CHECKING, Any

from lowsync import _native
from lowsync._native import LowsyncError, available_backends, version
from lowsync.bench import (
    POLICIES,
    BatchedRow,
    BenchRow,
    Progress,
    RowPrinter,
    batched_n_ctx,
    format_batched,
    legacy_env,
    legacy_switches,
    parse_backends,
    run_batched,
    run_bench,
)
from lowsync.models.llama import BUILTIN_CONFIGS, Llama
from lowsync.quants import QUANTIZABLE

if TYPE_CHECKING:  # imported when `run` or `chat` runs: `lowsync bench` needs no tokenizer
    from lowsync.llm import LLM
    from lowsync.tokenizer import Tokenizer

# Backends the bench skips unless asked for by name: `noop` runs no kernel, so its rows measure
# host overhead alone and would read as absurd throughput next to real backends.
_OPT_IN_BACKENDS = frozenset({"noop"})

# Exit statuses of a bench stopped part-way (as a shell reports Ctrl-C and timeout(1) a timeout).
EXIT_INTERRUPTED = 130
EXIT_TIMEOUT = 124


# The context `run` asks for by default is rounded up to this many tokens (attention spans
# every cell, so a context sized to the work decodes faster); `chat`'s default context.
_CTX_ROUND = 256
_CHAT_CTX = 4096


class BenchTimeout(Exception):
    """`--timeout` ran out (raised in the main thread by SIGALRM, also inside a native wait)."""


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _positive(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {v}")
    return v


def _ahead_list(text: str) -> list[int]:
    out = []
    for item in text.split(","):
        if item.strip() not in ("0", "1"):
            raise argparse.ArgumentTypeError(f"expected a list of 0 and 1, got {text!r}")
        out.append(int(item))
    return sorted(set(out))


def _seconds(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not math.isfinite(v) or v <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text!r}")
    return v


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "-m",
        "--model",
        metavar="MODEL",
        default="tiny",
        help=f"a GGUF file, or a built-in model ({', '.join(BUILTIN_CONFIGS)}); default: tiny",
    )
    p.add_argument(
        "--backend",
        action="append",
        metavar="NAME",
        help="backend to run (repeatable or comma list; `a+b` is one context of several "
        "backends); default: every available backend except noop",
    )
    p.add_argument(
        "--policy",
        action="append",
        metavar="NAME",
        help="sync policy (repeatable or comma list); default: stock, relaxed and staged",
    )
    p.add_argument(
        "-ub",
        "--n-ubatch",
        type=_positive,
        default=32,
        metavar="N",
        help="tokens per ubatch (the prefill graph's size); default: 32",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the prompt and built-in weights")
    p.add_argument(
        "-t",
        "--type",
        choices=("f32", "f16", "bf16", *QUANTIZABLE),
        default="f32",
        help="weight type of a built-in model (default: f32; the q* types are quantized with the "
        "gguf package; GGUF files keep their own)",
    )
    p.add_argument("--json", action="store_true", help="print the rows as a JSON list")


def _probability(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0.0 <= v <= 1.0:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1, got {text!r}")
    return v


def _non_negative_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(v) or v < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return v


def _finite_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return v


def _non_negative(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, got {v}")
    return v


def _n_predict(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if v == 0 or v < -1:
        raise argparse.ArgumentTypeError(f"must be -1 (no limit) or a positive count, got {v}")
    return v


def _add_generation(p: argparse.ArgumentParser, n_help: str, ctx_help: str) -> None:
    """Options `run` and `chat` share: the model, where it runs, and llama.cpp's sampling."""
    p.add_argument("-m", "--model", required=True, metavar="FILE", help="a GGUF file")
    p.add_argument("-n", "--n-predict", type=_n_predict, default=-1, metavar="N", help=n_help)
    p.add_argument(
        "--backend",
        metavar="NAME",
        help="backend to run on, e.g. cpu, cpu-async, cuda, vulkan:0 (`a+b` for several); "
        "default: a CUDA device, else a Vulkan GPU, else cpu-async",
    )
    p.add_argument(
        "--policy", choices=POLICIES, help="sync policy (default: LOWSYNC_SYNC_POLICY or staged)"
    )
    p.add_argument(
        "-c",
        "--ctx",
        type=_positive,
        metavar="N",
        help=f"context size in tokens (KV cells); default: {ctx_help}, at most the model's "
        "training context",
    )
    p.add_argument(
        "--temp",
        type=_non_negative_float,
        default=0.8,
        metavar="T",
        help="temperature; 0 is greedy (0.8)",
    )
    p.add_argument("--top-k", type=_non_negative, default=40, metavar="K", help="0 = off (40)")
    p.add_argument("--top-p", type=_probability, default=0.95, metavar="P", help="1 = off (0.95)")
    p.add_argument("--min-p", type=_probability, default=0.05, metavar="P", help="0 = off (0.05)")
    p.add_argument(
        "--repeat-penalty",
        type=_non_negative_float,
        default=1.0,
        metavar="R",
        help="repetition penalty over the last --repeat-last-n tokens, 1 = off (1.0)",
    )
    p.add_argument(
        "--repeat-last-n",
        type=_non_negative,
        default=64,
        metavar="N",
        help="tokens the penalties look back over (64)",
    )
    p.add_argument(
        "--presence-penalty", type=_finite_float, default=0.0, metavar="P", help="0 = off (0)"
    )
    p.add_argument(
        "--frequency-penalty", type=_finite_float, default=0.0, metavar="P", help="0 = off (0)"
    )
    p.add_argument(
        "-s", "--seed", type=int, default=-1, metavar="S", help="sampling seed; -1: random (-1)"
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lowsync", description="lowsync command line")
    parser.add_argument("--version", action="version", version=f"lowsync {version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    run = sub.add_parser(
        "run",
        help="continue a prompt, streaming the text; tokens/s and host waits per token",
        description=(
            "Continues the prompt with the model (no chat template unless --chat), streams "
            "the text to stdout and ends with one line on stderr: tokens, tokens/s and host "
            "waits per generated token."
        ),
    )
    _add_generation(
        run,
        "tokens to generate; -1: until end of text or a full context (-1)",
        "the prompt and -n rounded up to 256 (2048 with -n -1)",
    )
    run.add_argument("-p", "--prompt", required=True, metavar="TEXT", help="the prompt")
    run.add_argument(
        "--chat",
        action="store_true",
        help="send the prompt as a user message through the model's chat template",
    )
    run.add_argument("--system", metavar="TEXT", help="with --chat: a system message")

    chat = sub.add_parser(
        "chat",
        help="an interactive chat with the model's template (a terminal or a pipe)",
        description=(
            "Reads one message per line from stdin and streams the model's answers to stdout, "
            "keeping the conversation (each turn decodes only its new tokens). Ends at end of "
            "input or /exit. Each answer's counts go to stderr."
        ),
    )
    _add_generation(
        chat,
        "most tokens per answer; -1: until end of turn or a full context (-1)",
        str(_CHAT_CTX),
    )
    chat.add_argument("--system", metavar="TEXT", help="a system message opening the chat")

    bench = sub.add_parser(
        "bench",
        help="prompt and generation speed with host-side counters per generated token",
        description=(
            "Decodes a prompt and generates tokens greedily on each backend under each sync "
            "policy; prints pp and tg tokens/s and, per generated token, the backends' counters."
        ),
    )
    _add_common(bench)
    bench.add_argument("-p", "--n-prompt", type=_positive, default=32, help="prompt tokens (32)")
    bench.add_argument("-n", "--n-gen", type=_positive, default=32, help="generated tokens (32)")
    bench.add_argument("-r", "--repetitions", type=_positive, default=1, help="repetitions (1)")
    bench.add_argument(
        "-ctk",
        "--kv-dtype",
        choices=("f32", "f16", "bf16"),
        default="f32",
        help="KV cache dtype (default: f32; llama-bench's default is f16)",
    )
    bench.add_argument(
        "--launch-ahead",
        type=_ahead_list,
        default=[0, 1],
        metavar="0,1",
        help="staged rows without (0) and with (1) launch-ahead: step t+1 queued before token "
        "t is read, fed on the device; a backend that cannot gets no 1 row (default: 0,1)",
    )
    bench.add_argument(
        "--timeout",
        type=_seconds,
        metavar="SECONDS",
        help="stop after SECONDS (also inside a row) and keep the rows finished by then "
        "(exit status 124); default: no limit",
    )

    batched = sub.add_parser(
        "batched-bench",
        help="llama-batched-bench: parallel sequences, optionally sharing one prompt",
        description=(
            "For each PP x TG x B: decode B prompts of PP tokens (or one shared through seq_cp "
            "with -pps), then TG steps of B tokens; reports speeds and reallocations (must be 0)."
        ),
    )
    _add_common(batched)
    batched.add_argument("-npp", type=_int_list, default=[128], help="prompt tokens (list)")
    batched.add_argument("-ntg", type=_int_list, default=[32], help="generated tokens (list)")
    batched.add_argument("-npl", type=_int_list, default=[1, 2, 4], help="parallel sequences")
    batched.add_argument("-pps", action="store_true", help="share one prompt between sequences")
    batched.add_argument("-c", "--n-ctx", type=_positive, help="KV cells (default: what fits)")
    return parser


def _load_model(spec: str, seed: int, command: str, dtype: str = "f32") -> Llama | None:
    """The model named on the command line, or None after printing why it cannot be loaded."""
    if spec in BUILTIN_CONFIGS:
        return Llama.random(spec, seed=seed, dtype=dtype)
    from lowsync.gguf import load_gguf

    try:
        return load_gguf(spec)
    except (LowsyncError, OSError) as e:
        print(f"lowsync {command}: {e}", file=sys.stderr)
        return None


def software_devices(names: Sequence[str]) -> list[str]:
    """The Vulkan devices among `names` whose device type is CPU (a software rasteriser such
    as lavapipe), as the native module reports it.

    The type comes from `lowsync._native.device_type(name)` (VkPhysicalDeviceType: "cpu",
    "discrete_gpu", ...), never from a device name; a native module without that function
    cannot tell, and then no device counts as one."""
    device_type = getattr(_native, "device_type", None)
    if device_type is None:
        return []
    return [b for b in names if b.split(":", 1)[0] == "vulkan" and device_type(b) == "cpu"]


def _backends(args: argparse.Namespace) -> list[list[str]]:
    if args.backend:
        return parse_backends(args.backend)
    names = [b for b in available_backends() if b not in _OPT_IN_BACKENDS]
    skipped = software_devices(names)
    if skipped:
        print(
            f"lowsync {args.command}: skipping {', '.join(skipped)}: a CPU-type Vulkan device "
            "(software rasteriser); name it with --backend to run it",
            file=sys.stderr,
        )
    return [[b] for b in names if b not in skipped]


def _policies(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[str]:
    if not args.policy:
        return list(POLICIES)
    out = [p.strip() for v in args.policy for p in v.split(",") if p.strip()]
    for p in out:
        if p not in POLICIES:
            parser.error(f"unknown policy {p!r} (choose from {', '.join(POLICIES)})")
    return out


@contextmanager
def _deadline(seconds: float | None) -> Iterator[None]:
    """Raises `BenchTimeout` in the block once `seconds` have passed: through SIGALRM, so a
    native wait is interrupted too (it polls Python's signal handlers). Outside the main thread,
    or without `setitimer`, nothing is armed and the caller checks between rows."""
    if (
        seconds is None
        or not hasattr(signal, "setitimer")
        or threading.current_thread() is not threading.main_thread()
    ):
        yield
        return

    def ring(signum: int, frame: FrameType | None) -> None:
        raise BenchTimeout(f"timed out after {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, ring)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _bench(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    policies = _policies(args, parser)
    model = _load_model(args.model, args.seed, "bench", args.type)
    if model is None:
        return 1
    # Launch-ahead needs the staged policy: other policies run the plain loop only.
    runs = [
        (b, p, ahead)
        for b in _backends(args)
        for p in policies
        for ahead in (args.launch_ahead if p == "staged" else [0])
    ]
    labels = [
        (
            "+".join(b),
            p + ("+ahead" if ahead else "") + ("*" if legacy_env(p, b) else ""),
        )
        for b, p, ahead in runs
    ]
    progress = Progress(len(runs) * args.repetitions)
    printer = None if args.json else RowPrinter(sys.stdout, model, labels, args.repetitions)
    rows: list[BenchRow] = []
    label = ""
    status, stopped = 0, ""
    deadline = None if args.timeout is None else time.monotonic() + args.timeout
    try:
        with _deadline(args.timeout):
            for backends, policy, ahead in runs:
                if deadline is not None and time.monotonic() >= deadline:
                    raise BenchTimeout(f"timed out after {args.timeout:g} s")
                label = f"{'+'.join(backends)}/{policy}{'+ahead' if ahead else ''}"
                row = run_bench(
                    model,
                    backends,
                    policy,
                    n_prompt=args.n_prompt,
                    n_gen=args.n_gen,
                    reps=args.repetitions,
                    n_ubatch=args.n_ubatch,
                    seed=args.seed,
                    on_rep=functools.partial(progress.update, label),
                    launch_ahead=bool(ahead),
                    kv_dtype=args.kv_dtype,
                )
                if row is not None:
                    rows.append(row)
                    if printer is not None:
                        progress.close()  # the bar (stderr) off the line the row goes on
                        printer.add(row)
    except LowsyncError as e:
        status, stopped = 1, f"{label}: {e}"
    except KeyboardInterrupt:
        status, stopped = EXIT_INTERRUPTED, f"interrupted in {label}"
    except BenchTimeout as e:
        status, stopped = EXIT_TIMEOUT, f"{e}, in {label}"
    progress.close()
    if printer is not None:
        printer.close()
    elif status != 1:
        print(json.dumps([r.as_dict() for r in rows], indent=2))
    if stopped:
        kept = f"; {len(rows)} finished row(s) kept" if status != 1 else ""
        print(f"lowsync bench: {stopped}{kept}", file=sys.stderr)
    return status


def _batched(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from lowsync.session import Session

    policies = _policies(args, parser)
    model = _load_model(args.model, args.seed, "batched-bench", args.type)
    if model is None:
        return 1
    need = batched_n_ctx(args.npp, args.ntg, args.npl, args.pps)
    n_ctx = args.n_ctx or need
    if n_ctx < need:
        parser.error(f"-c {n_ctx} is too small: the largest run needs {need} KV cells")
    combos = [(p, t, b) for p in args.npp for t in args.ntg for b in args.npl]
    pairs = [(b, p) for b in _backends(args) for p in policies]
    progress = Progress(len(pairs) * len(combos))
    rows: list[BatchedRow] = []
    label = ""
    try:
        for backends, policy in pairs:
            label = f"{'+'.join(backends)}/{policy}"
            with legacy_switches(policy, backends):
                sess = Session(
                    model,
                    backends=backends,
                    n_ctx=n_ctx,
                    n_seq=max(args.npl),
                    n_ubatch=args.n_ubatch,
                    policy=policy,
                    # A graph per batch size, so a TG step of B sequences is not padded to -ub.
                    buckets=sorted({1, *(b for b in args.npl if b <= args.n_ubatch)}),
                )
                legacy = tuple(f"{k}={v}" for k, v in sorted(legacy_env(policy, backends).items()))
                for npp, ntg, npl in combos:
                    row = run_batched(sess, npp, ntg, npl, args.pps, seed=args.seed)
                    rows.append(dataclasses.replace(row, legacy=legacy))
                    progress.update(f"{label} pp{npp} tg{ntg} b{npl}")
    except LowsyncError as e:
        progress.close()
        print(f"lowsync batched-bench: {label}: {e}", file=sys.stderr)
        return 1
    progress.close()
    if args.json:
        print(json.dumps([r.as_dict() for r in rows], indent=2))
    else:
        print(format_batched(rows))
    bad = [r for r in rows if r.reallocs]
    if bad:
        print(
            f"lowsync batched-bench: {len(bad)} run(s) reallocated after the reserve "
            "(expected 0; see LOWSYNC_SCHED_DEBUG_REALLOC)",
            file=sys.stderr,
        )
        return 1
    return 0


# ---- run and chat ---------------------------------------------------------------------------


class _Fail(Exception):
    """A one-line error a command prints before it exits with status 1."""


def _open_llm(args: argparse.Namespace, want_ctx: Callable[[Tokenizer], int]) -> LLM:
    """The `LLM` of `run` / `chat`; `want_ctx(tokenizer)` sizes the context when --ctx is not
    given. Raises `_Fail` with the reason when the model or its tokenizer cannot be used."""
    from lowsync.gguf import load_gguf
    from lowsync.llm import LLM
    from lowsync.tokenizer import Tokenizer

    try:
        model = load_gguf(args.model)
        tokenizer = Tokenizer.from_metadata(model.metadata, args.model)
        n_ctx = args.ctx or min(want_ctx(tokenizer), model.config.n_ctx_train)
        backend = None if args.backend is None else args.backend.split("+")
        return LLM(
            model,
            backend=backend,
            n_ctx=n_ctx,
            policy=args.policy,
            seed=None if args.seed < 0 else args.seed,
            tokenizer=tokenizer,
            penalty_last_n=args.repeat_last_n,
        )
    except (LowsyncError, OSError) as e:
        raise _Fail(str(e)) from None


def _sampling(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "max_tokens": args.n_predict,
        "temperature": args.temp,
        "top_k": args.top_k,
        "top_p": args.top_p,
        "min_p": args.min_p,
        "repeat_penalty": args.repeat_penalty,
        "presence_penalty": args.presence_penalty,
        "frequency_penalty": args.frequency_penalty,
    }


def _stats_line(llm: LLM, n_tokens: int, note: str = "") -> str:
    """`[8 tokens, 95.1 tok/s, 1.00 host waits/token (cpu-async, staged)]`: the rate and the
    waits are those of the decode steps (each generated token after the first), as the bench
    reports them; the prompt's are not in them."""
    where = f"{'+'.join(llm.backends)}, {llm.policy}"
    st = llm.last_stats
    if st is None or st.n_steps == 0:
        return f"[{n_tokens} tokens ({where}){note}]"
    return (
        f"[{n_tokens} tokens, {st.tg_tps:.1f} tok/s, "
        f"{st.per_token['host_waits']:.2f} host waits/token ({where}){note}]"
    )


def _stream_out(chunks: Iterator[dict[str, Any]], parts: list[str], chat: bool) -> int:
    """Writes the chunks' text to stdout as it comes and appends it to `parts` (kept when
    Ctrl-C stops the stream); returns the number of generated tokens (the last chunk's
    usage)."""
    n_tokens = 0
    for chunk in chunks:
        choice = chunk["choices"][0]
        text = choice["delta"].get("content", "") if chat else choice["text"]
        if text:
            parts.append(text)
            sys.stdout.write(text)
            sys.stdout.flush()
        if "usage" in chunk:
            n_tokens = chunk["usage"]["completion_tokens"]
    return n_tokens


def _run(args: argparse.Namespace) -> int:
    def want_ctx(tokenizer: Tokenizer) -> int:
        if args.n_predict < 0:
            return 2048
        n_prompt = len(tokenizer.encode(args.prompt, add_special=True, parse_special=True))
        need: int = n_prompt + args.n_predict + (64 if args.chat else 0)  # the template's
        return -(-need // _CTX_ROUND) * _CTX_ROUND

    try:
        llm = _open_llm(args, want_ctx)
        seed = None if args.seed < 0 else args.seed  # the sampler's own seed, as in the API
        if args.chat:
            messages = [{"role": "user", "content": args.prompt}]
            if args.system:
                messages.insert(0, {"role": "system", "content": args.system})
            chunks = llm.create_chat_completion(messages, seed=seed, stream=True, **_sampling(args))
        else:
            chunks = llm.create_completion(args.prompt, seed=seed, stream=True, **_sampling(args))
        try:
            n_tokens = _stream_out(chunks, [], args.chat)
        except KeyboardInterrupt:
            chunks.close()
            sys.stdout.write("\n")
            sys.stdout.flush()
            print(_stats_line(llm, 0, ", interrupted"), file=sys.stderr)
            return EXIT_INTERRUPTED
    except (_Fail, LowsyncError) as e:
        print(f"lowsync run: {e}", file=sys.stderr)
        return 1
    sys.stdout.write("\n")
    sys.stdout.flush()
    print(_stats_line(llm, n_tokens), file=sys.stderr)
    return 0


def _read_message(interactive: bool) -> str | None:
    """The next line of input without its newline, or None at end of input."""
    if interactive:
        try:
            return input("> ")
        except EOFError:
            return None
    line = sys.stdin.readline()
    return None if line == "" else line.rstrip("\r\n")


def _chat(args: argparse.Namespace) -> int:
    interactive = sys.stdin.isatty() and sys.stdout.isatty()
    if interactive:
        with contextlib.suppress(ImportError):  # a Python built without it has no editing
            import readline  # noqa: F401  (line editing and history for input())
    try:
        llm = _open_llm(args, lambda tokenizer: _CHAT_CTX)
        # A model without a chat template is refused now, not after the first message.
        llm.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    except (_Fail, LowsyncError) as e:
        print(f"lowsync chat: {e}", file=sys.stderr)
        return 1
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    if interactive:
        print("lowsync chat: one message per line; /exit or Ctrl-D ends.", file=sys.stderr)
    while True:
        try:
            line = _read_message(interactive)
        except KeyboardInterrupt:
            print(file=sys.stderr)
            return EXIT_INTERRUPTED
        if line is None or line.strip() == "/exit":
            return 0
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        parts: list[str] = []
        note = ""
        try:
            chunks = llm.create_chat_completion(messages, stream=True, **_sampling(args))
            try:
                n_tokens = _stream_out(chunks, parts, chat=True)
            except KeyboardInterrupt:
                # Ctrl-C ends the answer, not the chat: what was said so far stays said.
                chunks.close()
                n_tokens, note = 0, ", interrupted"
        except LowsyncError as e:
            print(f"\nlowsync chat: {e}", file=sys.stderr)
            return 1
        sys.stdout.write("\n")
        sys.stdout.flush()
        messages.append({"role": "assistant", "content": "".join(parts)})
        print(_stats_line(llm, n_tokens, note), file=sys.stderr)


def _kernel_compile_notices() -> None:
    """Shows on stderr when a backend compiles its kernels (the CUDA backend's first open on a
    GPU compiles them with NVRTC, tens of seconds, then caches them), so a first run does not
    look hung. Through lowsync's tracing, filtered to that one message; where tracing is
    already on (an earlier command in this process, or the caller's `enable_tracing`), it
    stays as it is."""
    with contextlib.suppress(LowsyncError):
        _native.enable_tracing("lowsync_cuda::kernels=info")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `lowsync` script; returns the exit status.

    Examples: ``lowsync run -m model.gguf -p "The capital of France is" -n 8 --temp 0``,
    ``lowsync chat -m model.gguf``, ``lowsync bench``, ``lowsync bench -m model.gguf --backend
    cpu-async -p 64 -n 64 --json``, ``lowsync batched-bench -npp 128 -ntg 32 -npl 1,2,4 -pps``.
    """
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command is not None:
        _kernel_compile_notices()
    if args.command in ("run", "chat"):
        try:
            return _run(args) if args.command == "run" else _chat(args)
        except KeyboardInterrupt:  # while loading: nothing to keep
            print(f"lowsync {args.command}: interrupted", file=sys.stderr)
            return EXIT_INTERRUPTED
    if args.command == "bench":
        return _bench(args, parser)
    if args.command == "batched-bench":
        return _batched(args, parser)
    parser.print_help(sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
