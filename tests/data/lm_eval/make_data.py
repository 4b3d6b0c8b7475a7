"""Writes the two local lm-eval tasks' JSONL from Python's own docs (pydoc_data.topics, the builtin
corpus), deterministically: `python tests/data/lm_eval/make_data.py`. The files are committed.

pydoc_mc.jsonl   multiple choice: the first 12 words of a topic's paragraph, then which of 4 six-word
                 continuations follows (the true one, and the same span of 3 other topics), label its index
pydoc_ppl.jsonl  rolling perplexity: a paragraph of each of 12 topics, up to 40 words
"""

import json
import random
from pathlib import Path
from pydoc_data.topics import topics

HERE = Path(__file__).parent


def paragraphs() -> list[tuple[str, list[str]]]:
    out = []
    for name in sorted(topics):
        for para in topics[name].split("\n\n"):
            words = para.split()
            if len(words) >= 30 and not para.startswith(" "):
                out.append((name, words))
                break
    return out


def main() -> None:
    rng = random.Random(0)
    paras = paragraphs()
    mc = []
    for i, (name, words) in enumerate(paras[:24]):
        others = rng.sample([p for j, p in enumerate(paras) if j != i], 3)
        choices = [" " + " ".join(words[12:18])] + [" " + " ".join(w[12:18]) for _, w in others]
        order = list(range(4))
        rng.shuffle(order)
        mc.append(
            {
                "topic": name,
                "context": " ".join(words[:12]),
                "choices": [choices[k] for k in order],
                "label": order.index(0),
            }
        )
    ppl = [{"topic": name, "text": " ".join(words[:40])} for name, words in paras[24:36]]
    for file, rows in (("pydoc_mc.jsonl", mc), ("pydoc_ppl.jsonl", ppl)):
        (HERE / file).write_text("".join(json.dumps(r) + "\n" for r in rows))


if __name__ == "__main__":
    main()
