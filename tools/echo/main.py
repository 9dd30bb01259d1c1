import json
import sys

request = json.load(sys.stdin)
json.dump({"message": request["params"]["message"], "attempt": request["context"]["attempt"]}, sys.stdout)
