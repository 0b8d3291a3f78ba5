"""``python -m jaxascend.generate``: sample from a run, a checkpoint or a Hugging Face model.

    python -m jaxascend.generate --checkpoint runs/my-run --prompt "def main(" --max-new-tokens 64
    python -m jaxascend.generate --checkpoint /models/Qwen2.5-0.5B-Instruct --chat "Hi!" --temperature 0.7

``--checkpoint`` is a run's output folder, a checkpoint step or checkpoint directory, a
``params.safetensors`` file (all as ``python -m jaxascend.export`` reads them), a Hugging Face
model folder or a hub id (``Qwen/Qwen2.5-0.5B-Instruct``: its folder in the Hugging Face cache,
downloaded there when missing and the hub is online, as ``model.path`` reads it). Each
``--prompt`` is printed and continued, the new text streamed to stdout as it comes; ``--chat``
sends one user message through the chat template and prints the reply.
``--stream-layers auto`` reads the layer stack one layer at a time when the run kept it on SSD
(``offload.params: ssd``). Errors print one line and exit with status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import typing
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Sequence

from jaxascend import console
from jaxascend.config import DType

# JAX, the checkpoint readers and the tokenizers are imported where they are used, after the
# arguments are parsed, so that --help and bad usage answer without loading them.
if TYPE_CHECKING:
    from jaxascend.checkpoint import RunWeights
    from jaxascend.data import Tokenizer
    from jaxascend.generation import ChatFormat, Generator, SamplingConfig

PROG = "python -m jaxascend.generate"



def _parser(prog: str = PROG) -> argparse.ArgumentParser:
    p = console.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True, metavar="RUN_OR_STEP",
                   help="run output folder, checkpoint step or directory, params.safetensors, Hugging Face folder "
                        "or hub id (org/name)")
    p.add_argument("--prompt", action="append", default=[], metavar="TEXT", help="text to continue (repeatable)")
    p.add_argument("--chat", metavar="TEXT", help="one user message, sent through the chat template")
    p.add_argument("--chat-template", metavar="FILE", help="a Jinja chat template (default: the tokenizer's)")
    p.add_argument("--max-new-tokens", type=int, default=128, metavar="N")
    p.add_argument("--temperature", type=float, default=0.0, help="0 (the default): greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass, in (0, 1]")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer", help="tokenizer folder or 'byte' (default: the one the run used)")
    p.add_argument("--dtype", choices=typing.get_args(DType), help="compute dtype (default: the run's model.dtype)")
    p.add_argument("--stream-layers", choices=["auto", "on", "off"], default="auto",
                   help="read the layers one at a time (auto: when the run kept them on SSD)")
    return p


def _settings(args: argparse.Namespace) -> SamplingConfig:
    """The sampling settings, checked before anything is loaded; errors name the flag."""
    from jaxascend.generation import SamplingConfig

    try:
        return SamplingConfig(args.max_new_tokens, args.temperature, args.top_p, args.seed)
    except ValueError as err:
        field, _, rest = str(err).partition(":")
        raise ValueError(f"--{field.replace('_', '-')}:{rest}") from None


def _tokenizer_spec(args: argparse.Namespace, weights: RunWeights) -> str:
    """``--tokenizer``, else the run's tokenizer folder, else (a byte-level run) ``byte``."""
    return args.tokenizer or weights.tokenizer or "byte"


def _tokenizer(args: argparse.Namespace, weights: RunWeights) -> Tokenizer:
    from jaxascend.data import load_tokenizer

    tokenizer = load_tokenizer(_tokenizer_spec(args, weights))
    if tokenizer.vocab_size > weights.model_config.vocab_size:
        raise ValueError(f"--tokenizer: {tokenizer.vocab_size} tokens, more than the model's vocabulary "
                         f"({weights.model_config.vocab_size}); is it the tokenizer the run used?")
    return tokenizer


def chat_format(args: argparse.Namespace, tokenizer: Tokenizer, stop_ids: tuple[int, ...],
                run_config: Optional[dict] = None) -> ChatFormat:
    """How ``--chat`` becomes a prompt: ``--chat-template``, else the template the run trained
    with (its config's ``data.chat_template``, when that file still exists), else the
    tokenizer's own."""
    from jaxascend.generation import check_template_file, template_chat_format

    template = check_template_file(args.chat_template) if args.chat_template else None
    if template is None:
        trained = ((run_config or {}).get("data") or {}).get("chat_template")
        if trained and Path(trained).expanduser().is_file():
            template = trained
    return template_chat_format(tokenizer, template, stop_ids)


def run(args: argparse.Namespace, chat: Optional[ChatFormat] = None) -> int:
    """Generates for the parsed ``args`` (see the module doc), streaming to stdout. ``chat``
    overrides how a ``--chat`` message becomes prompt ids and which ids end the reply."""
    from jaxascend.generation import (Generator, check_prompt, generation_stop_ids, open_for_sampling,
                                      streams_layers)

    if bool(args.prompt) == (args.chat is not None):
        raise ValueError("give --prompt TEXT (one or more) or --chat TEXT" if not args.prompt
                         else "--prompt and --chat: give one or the other")
    if any(not text for text in args.prompt) or args.chat == "":
        raise ValueError(f"--{'chat' if args.chat is not None else 'prompt'}: empty text; give something to continue")
    settings = _settings(args)
    with open_for_sampling(args.checkpoint, dtype=args.dtype) as weights:
        tokenizer = _tokenizer(args, weights)
        folder = _tokenizer_spec(args, weights)
        stops = generation_stop_ids([None if folder == "byte" else folder, weights.model_source])
        if args.chat is not None:
            chat = chat or chat_format(args, tokenizer, stops, weights.run_config)
            prompts = [(None, chat.prompt_ids([{"role": "user", "content": args.chat}]))]
            stops = chat.stop_ids
        else:
            bos = [] if tokenizer.bos_id is None else [tokenizer.bos_id]  # as the run framed its documents
            prompts = [(text, bos + tokenizer.encode(text)) for text in args.prompt]
        prompts = [(text, check_prompt(ids, weights.model_config)) for text, ids in prompts]
        settings = dataclasses.replace(settings, stop_ids=tuple(dict.fromkeys(tuple(stops) + (tokenizer.eos_id,))),
                                       vocab_limit=tokenizer.vocab_size)
        stream = {"on": True, "off": False}.get(args.stream_layers, streams_layers(weights.run_config))
        with Generator(weights.model_config, weights.read, dtype=args.dtype, stream_layers=stream) as generator:
            for number, (text, ids) in enumerate(prompts):
                _generate(generator, tokenizer, text, ids, settings, first=number == 0)
    return 0


def _generate(generator: Generator, tokenizer: Tokenizer, text: Optional[str], ids, settings: SamplingConfig,
              first: bool) -> None:
    """One generation, streamed to stdout: the prompt (not a chat's), then the new text."""
    from jaxascend.generation import MAX_LENGTH, STOP_ID, TextStream

    reasons = {STOP_ID: "at a stop token", MAX_LENGTH: "at the model's max_position_embeddings"}
    out = sys.stdout
    if not first:
        out.write("\n")
    if text is not None:
        out.write(text)
    out.flush()
    pieces = TextStream(tokenizer, context=ids)

    def show(token: int) -> None:
        piece = pieces.push(token)
        if piece:
            out.write(piece)
            out.flush()

    result = generator.generate(ids, settings, on_token=show)
    out.write(pieces.flush() + "\n")
    out.flush()
    console.note(f"{len(result.tokens)} new tokens in {result.seconds:.2f} s (the first after "
                 f"{result.token_seconds[0]:.2f} s, then {result.tokens_per_second:.1f} tokens/s), stopped "
                 f"{reasons.get(result.stop_reason, 'after --max-new-tokens')}"
                 f"{'; layers read one at a time' if generator.stream_layers else ''}")


def main(argv: Optional[Sequence[str]] = None, prog: str = PROG) -> int:
    """The CLI (``prog``: the name its usage line shows): 0 when every prompt was generated, 2
    (after one ``error:`` line) otherwise."""
    args = _parser(prog).parse_args(argv)
    from jaxascend.checkpoint import CheckpointError

    with console.one_line_output():  # ConfigError is a ValueError
        return console.report_errors(lambda: run(args), (ValueError, OSError, CheckpointError))


if __name__ == "__main__":
    sys.exit(main())
