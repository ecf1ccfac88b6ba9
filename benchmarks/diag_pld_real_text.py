"""Prompt lookup variants scored offline on a real model's answers (CPU, no GPU needed).

    PYTHONPATH=. python3 benchmarks/diag_pld_real_text.py [GGUF]

SmolLM2-135M-Instruct (the test suite's real model: scripts/fetch_test_models.sh) writes greedy
answers to summarise / rename / edit / free-writing prompts; each lookup variant then drafts
over prompt + answer at a fixed depth, and a step is charged at the Qwen3-8B shape's measured
H100 costs (a verify of n tokens, a pipelined plain token). Printed per variant and depth: tokens
a step, acceptance, and the speed over plain decoding (geometric mean over the prompts).

Variants: ``shipped`` (``PromptLookupDrafter``); ``substitution``, the rule of a91899d (reverted):
with no n-gram match, take the last token as a replacement of one in a copy and resume the copy
one token on, after a copy of at least ``--run`` tokens; ``one-gram``: n-grams down to 1 token.
"""

import argparse
import os
import statistics
import tempfile

from mlxspec.engine.drafters.pld import PromptLookupDrafter

# the 8B shape on an H100 (real-h100-8b-echo-substitution.json): a verify of n tokens, and a
# pipelined plain token, in units of a waited 1-token forward
CURVE = {1: 1.0, 2: 1.096, 3: 1.134, 4: 1.149, 5: 1.209, 6: 1.204, 7: 1.271, 8: 1.32, 9: 1.412}
PLAIN = 0.742
DOC = ("The meeting on Tuesday covered three topics. First, the budget for the new office was approved "
       "at 40,000 euros. Second, the team agreed to move the product launch from March to April because "
       "testing is not finished. Third, Anna will lead the hiring of two new engineers.")
CODE = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n"
CODE2 = ('import json\n\ndef load_config(path):\n    with open(path) as f:\n        data = json.load(f)\n'
         '    if "name" not in data:\n        raise ValueError("config needs a name")\n    return data\n\n'
         'def save_config(path, data):\n    with open(path, "w") as f:\n        json.dump(data, f, indent=2)\n')
PROMPTS = [
    "Summarize this text in two sentences:\n\n" + DOC,
    "Rename the function add to plus in this code and return the whole code:\n\n" + CODE,
    "Rename the variable data to config everywhere in this code and return the whole code:\n\n" + CODE2,
    "Add a docstring to each function in this code and return the whole code:\n\n" + CODE2,
    "Fix the spelling mistakes in this text and return it whole:\n\n"
    + DOC.replace("budget", "budjet").replace("engineers", "enginers"),
    "Write a short story about a robot learning to paint.",
    "Explain how a hash table works.",
    "Translate this text to French:\n\n" + DOC,
    "Rewrite this text in the past tense, changing nothing else:\n\n"
    + DOC.replace("covered", "covers").replace("was approved", "is approved"),
    "Convert this code to use pathlib and return the whole code:\n\n" + CODE2,
]


class Substitution(PromptLookupDrafter):
    """a91899d's rule, reverted: past a token that replaced one of a long copy, resume the copy."""

    run = 12

    def _search(self, tokens, k):
        return super()._search(tokens, k) or self._resumed(tokens, k)

    def _resumed(self, tokens, k):
        edited = len(tokens) - 1
        for n in range(min(self.max_ngram, edited - 1), max(self.min_ngram, 3) - 1, -1):
            gram = tuple(tokens[edited - n : edited])
            latest = self._index.get(gram)
            for end in ([latest] if latest is not None else []) + self._earlier.get(gram, [])[::-1]:
                copied = 0
                while copied < self.run and end - copied >= 0 and tokens[end - copied] == tokens[edited - 1 - copied]:
                    copied += 1
                if end + 2 < edited and copied >= self.run:
                    return self._copy(tokens, end + 1, k)
        return []


def score(make, answers, k):
    per = []
    for prompt, answer in answers:
        target, d = prompt + answer, make()
        d.start(list(prompt))
        tokens, cost, steps, drafted, accepted = list(prompt), 0.0, 0, 0, 0
        while len(tokens) < len(target):
            draft = d.lookup(tokens, min(k, len(target) - len(tokens) - 1))
            a = 0
            while a < len(draft) and draft[a] == target[len(tokens) + a]:
                a += 1
            cost += CURVE[len(draft) + 1] if draft else PLAIN
            steps, drafted, accepted = steps + 1, drafted + len(draft), accepted + a
            tokens += target[len(tokens) : len(tokens) + a + 1]
        per.append((len(answer) / steps, accepted / max(drafted, 1), len(answer) * PLAIN / cost))
    return [statistics.mean(x[0] for x in per), statistics.mean(x[1] for x in per),
            statistics.geometric_mean(x[2] for x in per)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("gguf", nargs="?",
                    default=os.path.expanduser("~/.cache/mlxspec-tests/SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--run", type=int, default=12, help="the substitution rule's shortest copy")
    a = ap.parse_args()
    from mlxspec.api import load
    from mlxspec.models.gguf import convert_gguf

    folder = os.path.join(tempfile.mkdtemp(), "model")
    convert_gguf(a.gguf, folder)
    model = load(folder)
    answers = [(model.encode(p), list(model.generate(p, temperature=0, max_tokens=a.tokens, drafter="none").tokens))
               for p in PROMPTS]
    Substitution.run = a.run
    variants = {"shipped": PromptLookupDrafter, "substitution": Substitution,
                "one-gram": lambda: PromptLookupDrafter(max_ngram=4, min_ngram=1)}
    for k in (4, 8):
        for name, make in variants.items():
            tps, acc, speed = score(make, answers, k)
            print(f"depth {k}  {name:13s} tokens a step {tps:.2f}  acceptance {acc:.2f}  speed over plain {speed:.3f}")


if __name__ == "__main__":
    main()
