"""A fact told in a chat's first turn, asked for after many turns of conversation.

Turn 1 tells the model a secret word; then the user pastes passages of a book, one
turn each (a short greedy reply to each), until the conversation holds ``--tokens``
tokens; the last turn asks for the word. Each cache (the window alone, the window with
``--recall``) runs the same conversation through ``ChatSession`` (what ``mlx-stream
chat`` uses). One JSON line per trial and cache: the answer, whether it holds the word,
the tokens in the conversation, how far back the fact was told, the store's bytes.

    python benchmarks/recall_chat.py --tokens 20000 --trials 3 --out benchmarks/results/recall_chat/recall_chat.jsonl
"""

from __future__ import annotations

import random
import time

from common import (  # first: it preloads OpenBLAS before mlx.core
    base_parser,
    base_record,
    book_tokens,
    emit,
    load_model,
    main_guard,
)

from mlx_stream.cache.spec import CacheSpec
from mlx_stream.eval.needle import WORDS
from mlx_stream.generate.session import ChatSession, Settings
from mlx_stream.recall import RecallSpec, tier_of
from mlx_stream.recall.spec import PLACEMENT

TELL = "Hi! Please remember this: my secret word is {w}. I will ask you for it later."
ASK = "What is my secret word? Answer with the word only."
PASTE = "Here is a passage I am reading:\n\n{p}"


def passages(tokenizer, book: str, words: int, total: int) -> list[str]:
    """Passages of about ``words`` words from ``book``, enough for ``total`` tokens."""
    text = tokenizer.decode(book_tokens(tokenizer, total, book))
    split = text.split()
    return [" ".join(split[i : i + words]) for i in range(0, len(split), words)]


def seen(session: ChatSession) -> int:
    """Tokens the session's target cache has seen."""
    return session.caches[0].tokens_seen


def converse(model, tokenizer, cache: CacheSpec, word: str, chunks: list[str], tokens: int,
             reply_tokens: int) -> dict:  # fmt: skip
    session = ChatSession(model, tokenizer, Settings(cache=cache, max_tokens=reply_tokens))
    session.reply(TELL.format(w=word), lambda _: None)
    told_at = seen(session)
    turns = 1
    for chunk in chunks:
        if seen(session) >= tokens:
            break
        session.reply(PASTE.format(p=chunk), lambda _: None)
        turns += 1
    before = seen(session)
    got: list[str] = []
    session.reply(ASK, got.append, max_tokens=12)
    answer = "".join(got)
    recall = tier_of(session.caches)
    row = {"turns": turns + 1, "conversation_tokens": before, "fact_distance": before - told_at,
           "answer": answer, "found": word.lower() in answer.lower()}  # fmt: skip
    if recall is not None:
        row.update(store_bytes=recall.store_nbytes, region_bytes=recall.device_nbytes,
                   stored_blocks=recall.stored, selection=list(recall.selection))  # fmt: skip
        recall.close()
    return row


def main(argv: list[str] | None = None) -> list[dict]:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=20000, help="conversation tokens")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--caches", default="window,recall")
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--sinks", type=int, default=4)
    parser.add_argument("--blocks", type=int, default=8, help="recall blocks (k)")
    parser.add_argument("--book", default="moby_dick")
    parser.add_argument("--words", type=int, default=200, help="words per pasted passage")
    parser.add_argument("--reply-tokens", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.quick:
        args.tokens, args.trials, args.window, args.words = 600, 1, 64, 40
    model, tokenizer, weights = load_model(args.model, args.dtype)
    chunks = passages(tokenizer, args.book, args.words, 2 * args.tokens)
    rng = random.Random(args.seed)
    records = []
    for trial in range(args.trials):
        word = rng.choice(WORDS)
        for name in args.caches.split(","):
            recall = RecallSpec(blocks=args.blocks) if name == "recall" else None
            cache = CacheSpec(sinks=args.sinks, window=args.window, recall=recall)
            tic = time.perf_counter()
            row = converse(model, tokenizer, cache, word, chunks, args.tokens, args.reply_tokens)
            records.append(emit(base_record(
                "recall-chat", args.model, weights, cache=name, trial=trial, word=word,
                window=args.window, sinks=args.sinks, blocks=args.blocks,
                placement=PLACEMENT, seconds=round(time.perf_counter() - tic, 1),
                **row), args.out))  # fmt: skip
    return records


if __name__ == "__main__":
    main_guard(main)
