"""get_weather: the weather of a city, from the table beside this file (no network)."""

import json

from runner_tool import ToolError, run

with open("weather.json", encoding="utf-8") as table:
    WEATHER = json.load(table)


def main(params, context):
    entry = WEATHER.get(params["city"].strip().lower())
    if entry is None:
        raise ToolError(f"no weather data for {params['city']!r}", code="NOT_FOUND")
    unit = params.get("unit", "celsius")
    temperature = entry["celsius"] if unit == "celsius" else round(entry["celsius"] * 9 / 5 + 32, 1)
    return {"city": entry["city"], "temperature": temperature, "unit": unit, "condition": entry["condition"]}


if __name__ == "__main__":
    run(main)
