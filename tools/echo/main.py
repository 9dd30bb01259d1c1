"""echo: the message back, with the attempt it arrived on."""

from runner_tool import run


def main(params, context):
    return {"message": params["message"], "attempt": context["attempt"]}


if __name__ == "__main__":
    run(main)
