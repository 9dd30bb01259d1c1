"""add_numbers: the sum of a and b."""

from runner_tool import run


def main(params, context):
    return params["a"] + params["b"]


if __name__ == "__main__":
    # Nothing is left open or running at the end: the process may skip Python's shutdown.
    run(main, fast_exit=True)
