import json
import sys

request = json.load(sys.stdin)
params = request["params"]
json.dump(params["a"] + params["b"], sys.stdout)
