import json
import sys

text = json.load(sys.stdin)["params"]["text"]
json.dump({"lines": len(text.splitlines()), "words": len(text.split()), "characters": len(text)}, sys.stdout)
