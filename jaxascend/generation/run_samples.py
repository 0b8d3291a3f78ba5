"""The end of a training run: the trained model answers ``eval.sample_prompts``.

    samples = SamplePrompts.from_config(cfg, tokenizer, model_cfg)    # at the start: checks the prompts
    ...                                                                # training
    results = samples.generate(model_cfg, engine.compute_weights(), tokenizer, stream_layers=...)

With ``data.format: chat`` each prompt is one user message rendered with the run's chat template
(the one the training conversations went through) and the reply ends at the template's
end-of-turn token; otherwise the prompt is framed as training documents were (``[bos] + text``)
and continued. Greedy unless ``eval.sample_temperature > 0``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from jaxascend.config import Config, ModelConfig
from jaxascend.data import Tokenizer
from jaxascend.generation.chat import template_chat_format
from jaxascend.generation.generator import Generator, check_prompt
from jaxascend.generation.sampling import SamplingConfig
from jaxascend.generation.text import TextStream


@dataclass(frozen=True)
class SamplePrompts:
    """The prompts of ``eval.sample_prompts`` as token ids, and how to sample their answers."""

    texts: tuple[str, ...]
    ids: tuple[np.ndarray, ...]
    settings: SamplingConfig
    chat: bool

    @classmethod
    def from_config(cls, cfg: Config, tokenizer: Tokenizer, model_cfg: ModelConfig) -> Optional["SamplePrompts"]:
        """None without ``eval.sample_prompts``; ValueError naming the prompt when one cannot be
        rendered or does not fit the model (checked before the run writes anything)."""
        texts = tuple(cfg.eval.sample_prompts)
        if not texts:
            return None
        chat = cfg.data.format == "chat"
        if chat:
            chat_format = template_chat_format(tokenizer, cfg.data.chat_template)
            ids = [chat_format.prompt_ids([{"role": "user", "content": text}]) for text in texts]
            stops = chat_format.stop_ids
        else:
            bos = [] if tokenizer.bos_id is None else [int(tokenizer.bos_id)]
            ids = [np.asarray(bos + tokenizer.encode(text), np.int32) for text in texts]
            stops = (int(tokenizer.eos_id),)
        checked = []
        for number, (text, prompt) in enumerate(zip(texts, ids)):
            if not text:
                raise ValueError(f"eval.sample_prompts[{number}]: empty")
            try:
                checked.append(check_prompt(prompt, model_cfg))
            except ValueError as err:
                raise ValueError(f"eval.sample_prompts[{number}]: {err}") from None
        settings = SamplingConfig(max_new_tokens=cfg.eval.sample_max_tokens, temperature=cfg.eval.sample_temperature,
                                  top_p=cfg.eval.sample_top_p, seed=cfg.train.seed, stop_ids=tuple(stops),
                                  vocab_limit=tokenizer.vocab_size)
        return cls(texts, tuple(checked), settings, chat)

    def generate(self, model_cfg: ModelConfig, weights, tokenizer: Tokenizer, *,
                 stream_layers: bool = False) -> list[dict]:
        """One ``{"prompt", "completion", "new_tokens", "stop_reason"}`` per prompt, sampled from
        ``weights`` (a parameter tree or a reader, see :class:`Generator`)."""
        results = []
        with Generator(model_cfg, weights, stream_layers=stream_layers) as generator:
            for text, ids in zip(self.texts, self.ids):
                out = generator.generate(ids, self.settings)
                stream = TextStream(tokenizer, context=[int(i) for i in ids])
                completion = "".join(stream.push(t) for t in out.tokens) + stream.flush()
                results.append({"prompt": text, "completion": completion, "new_tokens": len(out.tokens),
                                "stop_reason": out.stop_reason})
        return results
