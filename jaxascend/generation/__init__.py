"""Sampling from a trained model: a key/value-cached decoding loop over any weight source.

* :class:`Generator` -- the model in the compute dtype, built one tensor at a time from a reader
  ``read(path, layer)`` or an in-memory tree, with jitted prefill/step functions over a cache of a
  bucketed length; ``stream_layers=True`` keeps only the embeddings, final norm and head resident
  and reads each layer just before it runs (the next one on a thread meanwhile);
* :class:`SamplingConfig` / :func:`sample_logits` -- greedy, temperature, top-p, seed, stop ids;
* :class:`TextStream` -- new tokens to printable text as they come (whole UTF-8 characters);
* :class:`SamplePrompts` -- ``eval.sample_prompts`` answered at the end of a training run (as chat
  turns with ``data.format: chat``);
* :class:`ChatFormat` / :func:`template_chat_format` -- a conversation through a chat template;
* :func:`open_for_sampling` / :func:`streams_layers` -- a run, checkpoint, params file or Hugging
  Face folder as weights, and whether the run kept its layers on SSD.

Imports :mod:`jaxascend.config`, :mod:`jaxascend.models`, :mod:`jaxascend.data`,
:mod:`jaxascend.hf` and :mod:`jaxascend.checkpoint`; the generate CLI uses it.
"""

from jaxascend.generation.chat import ChatFormat, check_template_file, template_chat_format
from jaxascend.generation.generator import Generator, MAX_LENGTH, MAX_NEW_TOKENS, STOP_ID, check_prompt
from jaxascend.generation.sampling import SamplingConfig, bucket_length, sample_logits
from jaxascend.generation.run_samples import SamplePrompts
from jaxascend.generation.text import TextStream, generation_stop_ids
from jaxascend.generation.weights import LayerStream, open_for_sampling, streams_layers

__all__ = [
    "ChatFormat", "Generator", "LayerStream", "MAX_LENGTH", "MAX_NEW_TOKENS", "STOP_ID", "SamplePrompts",
    "SamplingConfig", "TextStream", "bucket_length", "check_prompt", "check_template_file", "generation_stop_ids",
    "open_for_sampling", "sample_logits", "streams_layers", "template_chat_format",
]
