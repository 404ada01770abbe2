"""``k3 chat MODEL_DIR``: a conversation in the terminal (see ``k3core.serve.conversation``).

Commands at the ``user>`` prompt: ``/reset``, ``/save FILE``, ``/load FILE``, ``/help``,
``/exit`` (or end of input). Ctrl-C while a reply is being written stops it after the
current token and keeps the conversation; Ctrl-C at the prompt only clears the line. In a
terminal the line is edited and remembered with ``readline`` (``k3core.cli.line_input``).
"""

from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path
from typing import Any

import typer

from k3core.api.errors import K3Error, UsageError
from k3core.cli.guard import guarded, in_flags
from k3core.cli.line_input import LineReader
from k3core.cli.options import EngineFlags, engine_flags
from k3core.run.request import MAX_GEN
from k3core.serve.loading import DEFAULT_CONTEXT

_C = "Conversation"
_G = "Generation"
_X = "Engine"

HELP = ("commands: /reset (start over, keep the system message), /save FILE, /load FILE, "
        "/help, /exit; Ctrl-C stops a reply and keeps the conversation")


class Printer:
    """Writes a reply's pieces as they arrive: the thinking first, then the answer, then each
    tool call the model makes (``tool> NAME {arguments}``, a line each)."""

    def __init__(self, out: Any):
        self.out = out
        self.channel: str | None = None
        self.tools: dict[int, str] = {}  # call index -> the tool's name

    def __call__(self, piece: dict[str, Any]) -> None:
        for name, label in (("reasoning", "think> "), ("content", "k3> ")):
            text = piece.get(name)
            if not text:
                continue
            if self.channel != name:
                self.out.write(("\n" if self.channel else "") + label)
                self.channel = name
            self.out.write(text)
        for delta in piece.get("tool_calls") or []:
            fn = delta.get("function", {})
            if "id" in delta:
                self.tools[delta["index"]] = fn.get("name", "")
            elif fn.get("arguments"):
                self.out.write(("\n" if self.channel else "")
                               + f"tool> {self.tools.get(delta['index'], '')} {fn['arguments']}")
                self.channel = "tools"
        self.out.flush()

    def end(self) -> None:
        if self.channel is None:
            self.out.write("k3> ")
        self.out.write("\n")
        self.out.flush()


@guarded
@engine_flags(omit=("incremental",), panel=_X)
def chat(
    model_dir: Path = typer.Argument(..., help="Directory with the safetensors shards (and the tokenizer)."),
    system: str = typer.Option(None, "--system", help="A system message to open the conversation with.", rich_help_panel=_C),
    chat_format: str = typer.Option("auto", "--chat-format", help="auto (XTML when the tokenizer has its tokens), xtml or plain.", rich_help_panel=_C),
    think: bool = typer.Option(None, "--think/--no-think", help="Let the model think before it answers (XTML). Default: on, off for a model trained to answer without thinking (the demo model).", rich_help_panel=_C, show_default=False),
    thinking_effort: str = typer.Option("max", "--thinking-effort", help="low, high or max.", rich_help_panel=_C),
    load: Path = typer.Option(None, "--load", help="Resume the conversation saved in this file (/save).", rich_help_panel=_C),
    context: int = typer.Option(DEFAULT_CONTEXT, "--context", help="Tokens the conversation may hold.", rich_help_panel=_C),
    max_tokens: int = typer.Option(512, "--max-tokens", help=f"Most tokens one reply may have (1..{MAX_GEN}).", rich_help_panel=_G),
    temperature: float = typer.Option(None, "--temperature", help="Sample with this temperature (0 = greedy).", rich_help_panel=_G),
    top_p: float = typer.Option(None, "--top-p", help="Sample from the top-p mass.", rich_help_panel=_G),
    top_k: int = typer.Option(None, "--top-k", help="Sample from the k most likely ids.", rich_help_panel=_G),
    seed: int = typer.Option(None, "--seed", help="Sampling seed (turn k uses seed + k).", rich_help_panel=_G),
    spec: str = typer.Option("off", "--spec", help="Speculative decoding: off, ngram or auto (the same replies; docs/speculative.md).", rich_help_panel=_G),
    no_history: bool = typer.Option(False, "--no-history", help="Read and write no history file (in a terminal, Up still recalls this session's lines; $K3_CHAT_HISTORY names the file).", rich_help_panel=_C),
    *,
    flags: EngineFlags,
) -> None:
    """Talk with MODEL_DIR: state carried between turns, /save and /load."""
    if not 1 <= max_tokens <= MAX_GEN:
        raise UsageError(f"--max-tokens must be in 1..{MAX_GEN}, got {max_tokens}")
    from k3core.model.sampling import check_sampling
    from k3core.model.speculative import DEFAULT_NGRAM, DEFAULT_WIDTH, check_spec
    from k3core.run.engine import open_engine
    from k3core.serve.chat_format import chat_format_for, check_format_options
    from k3core.serve.conversation import Conversation
    from k3core.serve.loading import check_context, conversation_request, default_thinking

    check_spec(spec, DEFAULT_WIDTH, DEFAULT_NGRAM)
    check_sampling(temperature, top_p, top_k, seed)  # before the engine opens, not per turn
    check_context(context)
    check_format_options(chat_format, think is not False, thinking_effort)
    engine = open_engine(conversation_request(model_dir, context, flags.given))
    try:
        if engine.tokenizer is None:
            raise UsageError(f"k3 chat needs a tokenizer: none in {model_dir}; pass --tok DIR")
        if think is None:  # the model says (the demo model answers without thinking)
            think = default_thinking(engine.cfg.source)
        fmt = chat_format_for(engine.tokenizer, chat_format, thinking=think, effort=thinking_effort)
        conv = Conversation(engine.session(), fmt, system, context)
        if load is not None:
            conv.load(load)
        sampling = {"temperature": temperature, "top_p": top_p, "top_k": top_k, "seed": seed,
                    "spec": None if spec == "off" else spec}
        thinking = getattr(fmt, "thinking", None)
        how = "" if thinking is None else f", thinking {fmt.effort}" if thinking else ", no thinking"  # type: ignore[attr-defined]
        print(f"k3 chat: {model_dir.name} ({fmt.name} format{how}, context {context}); /help for commands",
              file=sys.stderr)
        if load is not None:
            print(f"loaded {load}: {len(conv.ids)} tokens, {conv.turns} turns", file=sys.stderr)
        reader = LineReader(history=not no_history)
        try:
            _loop(conv, max_tokens, {k: v for k, v in sampling.items() if v is not None}, reader)
        finally:
            reader.close()
    finally:
        engine.close()


def _read(reader: LineReader, prompt: str) -> str | None:
    """One line from the user; None at end of input. Ctrl-C gives back an empty line."""
    try:
        return reader.read(prompt)
    except EOFError:
        return None
    except KeyboardInterrupt:
        print("^C (/exit or Ctrl-D to leave)", file=sys.stderr)
        return ""


def _loop(conv: Any, max_tokens: int, sampling: dict[str, Any], reader: LineReader) -> None:
    while True:
        line = _read(reader, "user> ")
        if line is None:
            print(file=sys.stderr)
            return
        text = line.strip()
        if not text:
            continue
        if text.startswith("/"):
            if _command(conv, text):
                return
            continue
        _turn(conv, line, max_tokens, sampling)


def _command(conv: Any, text: str) -> bool:
    """Run a /command; True to leave."""
    name, _, arg = text.partition(" ")
    arg = arg.strip()
    try:
        if name in ("/exit", "/quit"):
            return True
        if name == "/help":
            print(HELP, file=sys.stderr)
        elif name == "/reset":
            conv.reset()
            print("conversation reset", file=sys.stderr)
        elif name in ("/save", "/load"):
            if not arg:
                raise UsageError(f"{name} needs a FILE")
            path = Path(arg).expanduser()
            if name == "/save":
                size = conv.save(path)
                print(f"saved {path} ({len(conv.ids)} tokens, {conv.turns} turns, {size} bytes)", file=sys.stderr)
            else:
                conv.load(path)
                print(f"loaded {path} ({len(conv.ids)} tokens, {conv.turns} turns)", file=sys.stderr)
        else:
            raise UsageError(f"unknown command {name}; {HELP}")
    except K3Error as exc:
        print(f"k3: error: {in_flags(exc)}", file=sys.stderr)
    return False


def _turn(conv: Any, text: str, max_tokens: int, sampling: dict[str, Any]) -> None:
    cancel = threading.Event()
    printer = Printer(sys.stdout)

    def on_sigint(signum: int, frame: Any) -> None:
        cancel.set()  # stop after the current token: a pass cut in half would spoil the state

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        res = conv.say(text, max_tokens, sampling, on_piece=printer, cancel=cancel)
    except K3Error as exc:
        print(f"k3: error: {in_flags(exc)}", file=sys.stderr)
        return
    finally:
        signal.signal(signal.SIGINT, previous)
    printer.end()
    how = {"stop": "ended", "length": "hit --max-tokens", "cancelled": "stopped by Ctrl-C"}[res.finish]
    print(f"({len(res.ids)} tokens, {how}; fed {res.prompt_fed} prompt tokens after {res.reused} "
          f"carried; the conversation holds {res.total}; {res.seconds:.2f} s)", file=sys.stderr)


def register(app: typer.Typer) -> None:
    app.command("chat")(chat)
