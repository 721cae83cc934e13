"""A character-level tokenizer built locally (no downloads), as a stock ``PreTrainedTokenizerFast``.

Every printable ASCII character (plus newline) is one token, so any text task can be written for it. Pitfalls
this avoids (measured, see DESIGN §7): a WordLevel model decodes with spaces between tokens unless the decoder
is ``Fuse``; BOS must be added by the post-processor so RL prompts are tokenized exactly as during SFT; pad gets
its own id (never reuse EOS: a left-padded prompt would look finished); generation uses left padding.
"""
from __future__ import annotations

import string

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
SPECIAL_TOKENS = [PAD, BOS, EOS, UNK]
CHARACTERS = [c for c in string.printable if c not in "\t\r\x0b\x0c"]  # 96 characters incl. space and newline


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """Character-level tokenizer: ids 0..3 are <pad>, <s>, </s>, <unk>; then one id per character."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in CHARACTERS:
        vocab[ch] = len(vocab)
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # One pre-token per character ("[\s\S]" so newlines split too); no normalisation, no whitespace stripping.
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])]
    )
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token=PAD, bos_token=BOS, eos_token=EOS, unk_token=UNK, padding_side="left"
    )
    return tok
