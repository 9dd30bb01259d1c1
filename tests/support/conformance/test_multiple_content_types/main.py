"""test_multiple_content_types: a tool of the MCP conformance suite's, written with the helper."""

import base64

import runner_tool as rt

# A 1x1 red PNG, and a WAV of one silent sample.
PNG = base64.b64decode(
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8DwHwAFBQIAX8jx0gAAAABJRU5ErkJggg=="
)
WAV = base64.b64decode("UklGRiYAAABXQVZFZm10IBAAAAABAAEAQB8AAIA+AAACABAAZGF0YQIAAAAAAA==")


def main(params, context):
    rt.text("Multiple content types test:")
    rt.image(PNG, "image/png")
    rt.resource(
        "test://mixed-content-resource", text='{"test": "data", "value": 123}', mime_type="application/json"
    )
    return {"blocks": 3}


rt.run(main)
