"""Write examples/mcp/inventory_tasks.jsonl: questions about a shop's stock that only the
inventory server's ``count`` tool can answer (the stock is in the task, which the server
reads; the question names only the item). ``python examples/mcp/make_tasks.py``"""

import json
import random
from pathlib import Path

ITEMS = ["apples", "pears", "plums", "figs", "limes", "kiwis", "dates", "grapes", "melons", "lemons"]


def main(n: int = 400, seed: int = 0) -> None:
    rng = random.Random(seed)
    out = Path(__file__).with_name("inventory_tasks.jsonl")
    with out.open("w") as f:
        for i in range(n):
            stock = {item: rng.randint(0, 99) for item in rng.sample(ITEMS, 4)}
            item = rng.choice(sorted(stock))
            f.write(json.dumps({
                "question": f"How many {item} does the shop have in stock? Answer with the number.",
                "answer": str(stock[item]),
                "stock": stock,
                "expert_calls": [{"name": "count", "arguments": {"item": item}}],
                "split": "heldout" if i % 5 == 4 else "train",
            }) + "\n")
    print(f"wrote {n} tasks to {out}")


if __name__ == "__main__":
    main()
