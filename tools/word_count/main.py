"""word_count: lines, words and characters of a text (runs in a container)."""

from runner_tool import run


def main(params, context):
    text = params["text"]
    return {"lines": len(text.splitlines()), "words": len(text.split()), "characters": len(text)}


if __name__ == "__main__":
    run(main)
