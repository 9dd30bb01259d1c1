"""test_tool_with_progress: a tool of the MCP conformance suite's, written with the helper."""

import base64
import time

import runner_tool as rt

# A 1x1 red PNG, and a WAV of one silent sample.
PNG = base64.b64decode(
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8DwHwAFBQIAX8jx0gAAAABJRU5ErkJggg=="
)
WAV = base64.b64decode("UklGRiYAAABXQVZFZm10IBAAAAABAAEAQB8AAIA+AAACABAAZGF0YQIAAAAAAA==")


def main(params, context):
    for done in (0, 50, 100):
        rt.progress(done, 100)
        time.sleep(0.05)
    return "progressed"


rt.run(main)
