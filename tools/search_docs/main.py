"""search_docs: lines of the bundled docs/*.txt that contain the query (case-insensitive)."""

from pathlib import Path

from runner_tool import run


def main(params, context):
    needle = params["query"].lower()
    hits = []
    for doc in sorted(Path("docs").glob("*.txt")):
        for number, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), start=1):
            if needle in line.lower():
                hits.append({"doc": doc.stem, "line": number, "text": line.strip()})
    return {"hits": hits[: params.get("limit", 5)]}


if __name__ == "__main__":
    run(main)
