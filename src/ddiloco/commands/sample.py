"""``ddiloco sample RUN_OR_CHECKPOINT --prompt TEXT``: text from the global model.

A plain autoregressive loop over the model's ``forward(idx) -> (logits, loss)``, cropped to
the context it was trained with, so ddiloco's GPT and Hugging Face models sample alike, on
any device: temperature, then top-k, then a draw from a generator seeded by ``--seed`` (the
same seed, the same text); ``--temperature 0`` takes the most likely token. Ids the
tokenizer does not know are never drawn. Prints the prompt and its continuation.
"""

from __future__ import annotations

import argparse
import json

import torch
from torch import nn

from ddiloco.commands.export import add_source_arguments, open_model
from ddiloco.errors import ConfigError
from ddiloco.trainer import sequence_length


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_source_arguments(parser, "RUN_OR_CHECKPOINT")
    parser.add_argument("--prompt", required=True, help="the text to continue")
    parser.add_argument("--tokens", type=int, default=200, help="tokens to generate (%(default)s)")
    parser.add_argument("--temperature", type=float, default=0.8, help="0: greedy (%(default)s)")
    parser.add_argument("--top-k", type=int, default=50, help="0: no cut (%(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="of the draws (%(default)s)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N (%(default)s)")
    parser.add_argument("--json", action="store_true", help="prompt, text and token ids as JSON")


@torch.no_grad()
def generate(
    model: nn.Module,
    prompt: list[int],
    tokens: int,
    *,
    context: int,
    vocab: int,
    temperature: float = 0.8,
    top_k: int = 50,
    seed: int = 0,
) -> list[int]:
    """``tokens`` ids continuing ``prompt`` (only ids below ``vocab``)."""
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    idx = torch.tensor([prompt], dtype=torch.long, device=device)
    out: list[int] = []
    model.eval()
    for _ in range(tokens):
        logits, _ = model(idx[:, -context:])
        last = logits[0, -1].float()
        last[vocab:] = -torch.inf
        if temperature == 0:
            token = last.argmax().view(1)
        else:
            last = last / temperature
            if 0 < top_k < last.numel():
                cut = torch.topk(last, top_k).values[-1]
                last[last < cut] = -torch.inf
            token = torch.multinomial(torch.softmax(last, -1), 1, generator=generator)
        out.append(int(token))
        idx = torch.cat([idx, token.view(1, 1)], dim=1)
    return out


def run(args: argparse.Namespace) -> int:
    for name, value, ok in (
        ("--tokens", args.tokens, args.tokens >= 0),
        ("--temperature", args.temperature, args.temperature >= 0),
        ("--top-k", args.top_k, args.top_k >= 0),
    ):
        if not ok:
            raise ConfigError(name, value, "must be >= 0")
    ckpt = open_model(args, args.device)
    prompt = ckpt.tokenizer.encode(args.prompt)
    if not prompt:
        raise ConfigError("--prompt", args.prompt, "encodes to no tokens: give some text")
    ids = generate(
        ckpt.model,
        prompt,
        args.tokens,
        context=sequence_length(ckpt.model, ckpt.config.train.seq_len),
        vocab=ckpt.tokenizer.vocab_size,
        temperature=args.temperature,
        top_k=args.top_k,
        seed=args.seed,
    )
    text = ckpt.tokenizer.decode(ids)
    if args.json:
        print(json.dumps({"prompt": args.prompt, "text": text, "tokens": ids}))
    else:
        print(args.prompt + text)
    return 0
