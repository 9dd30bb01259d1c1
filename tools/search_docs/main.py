import json
import sys
from pathlib import Path

params = json.load(sys.stdin)["params"]
needle = params["query"].lower()
limit = params.get("limit", 5)
hits = []
for doc in sorted(Path("docs").glob("*.txt")):
    for number, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), start=1):
        if needle in line.lower():
            hits.append({"doc": doc.stem, "line": number, "text": line.strip()})
json.dump({"hits": hits[:limit]}, sys.stdout)
