import json
import sys

with open("weather.json", encoding="utf-8") as table:
    WEATHER = json.load(table)

params = json.load(sys.stdin)["params"]
entry = WEATHER.get(params["city"].strip().lower())
if entry is None:
    json.dump({"error": {"message": f"no weather data for {params['city']!r}"}}, sys.stdout)
    sys.exit(1)
unit = params.get("unit", "celsius")
temperature = entry["celsius"] if unit == "celsius" else round(entry["celsius"] * 9 / 5 + 32, 1)
json.dump(
    {"city": entry["city"], "temperature": temperature, "unit": unit, "condition": entry["condition"]},
    sys.stdout,
)
