"""The tiny models of the built-in tasks: a word-level fast tokenizer (one token per character, or
per whitespace-separated word) and a small GPT-2 from random init, real transformers classes that
save and load through from_pretrained like any hub model."""

from __future__ import annotations

SPECIALS = ["<pad>", "<eos>", "<unk>"]


def wordlevel_tokenizer(tokens: list[str], per_character: bool):
    """SPECIALS + tokens as the vocabulary; per_character: every character is a token (and decoding
    joins them without the spaces WordLevel would insert), else whitespace-separated words."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS + list(tokens))}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    if per_character:
        tk.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
        tk.decoder = decoders.Fuse()
    else:
        tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def tiny_gpt2(tok, seed: int, *, n_positions: int, n_embd: int, n_layer: int, n_head: int = 4):
    """A GPT2LMHeadModel over tok's vocabulary, initialised from torch.manual_seed(seed)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=len(tok), n_positions=n_positions, n_embd=n_embd, n_layer=n_layer, n_head=n_head,
        # GPT-2's tanh-approximated GELU as one native kernel ("gelu_new" is five elementwise
        # ops, a quarter of a small model's forward time on CPU); same function.
        activation_function="gelu_pytorch_tanh",
        bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    return GPT2LMHeadModel(config)
