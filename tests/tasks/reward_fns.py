"""Top-level reward functions for the pool tests: the worker processes import them by name."""

import os
import time


def add(a, b):
    return a + b


def sleep_then(seconds, value):
    time.sleep(seconds)
    return value


def raise_value_error(message):
    raise ValueError(message)


def exit_process(code):
    os._exit(code)


def identity(value):
    return value


def pid(_):
    return float(os.getpid())
