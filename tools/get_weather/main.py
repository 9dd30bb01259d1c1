"""get_weather: the weather of a city, from a weather service when a key is configured,
else from the table beside this file (so the example also works offline).

The service is OpenWeatherMap's current-weather endpoint (``WEATHER_API_URL`` in the
manifest's ``env``). The key arrives as the secret ``WEATHER_API_KEY``; the only way out is
the runner's egress proxy (``HTTPS_PROXY``), which lets through the manifest's allow-list.
"""

import json
import os
import urllib.error
import urllib.parse
import urllib.request

from runner_tool import ToolError, run

TIMEOUT_S = 3


def not_found(city):
    return ToolError(f"no weather data for {city!r}", code="NOT_FOUND", details={"city": city})


def from_table(city):
    with open("weather.json", encoding="utf-8") as table:
        entry = json.load(table).get(city.strip().lower())
    if entry is None:
        raise not_found(city)
    return entry["city"], entry["celsius"], entry["condition"]


def from_service(city, key):
    query = urllib.parse.urlencode({"q": city, "units": "metric", "appid": key})
    url = f"{os.environ['WEATHER_API_URL']}?{query}"
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as response:
            data = json.load(response)
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            raise not_found(city) from None
        if exc.code in (401, 403):
            raise ToolError("the weather service refused the API key", code="UNAUTHORIZED") from None
        again = exc.code == 429 or exc.code >= 500  # worth another attempt; anything else is not
        message = f"the weather service answered {exc.code}"
        raise ToolError(message, code="UPSTREAM", retryable=again) from None
    except (urllib.error.URLError, TimeoutError, ValueError) as exc:
        message = f"the weather service is unreachable: {getattr(exc, 'reason', exc)}"
        raise ToolError(message, code="UPSTREAM", retryable=True) from None
    try:
        return data["name"], float(data["main"]["temp"]), data["weather"][0]["description"]
    except (KeyError, IndexError, TypeError, ValueError):
        raise ToolError("the weather service sent an answer of an unknown shape", code="UPSTREAM") from None


def main(params, context):
    key = os.environ.get("WEATHER_API_KEY")
    city = params["city"]
    name, celsius, condition = from_service(city, key) if key else from_table(city)
    unit = params.get("unit", "celsius")
    temperature = celsius if unit == "celsius" else round(celsius * 9 / 5 + 32, 1)
    return {"city": name, "temperature": temperature, "unit": unit, "condition": condition}


if __name__ == "__main__":
    run(main)
