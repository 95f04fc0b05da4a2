"""Reimplemented baselines (CAA, ITI, NL-ITI, ReFT) behind ``mari_eval.methods.Intervention``.

``mari_eval.methods.BUILTIN_METHODS`` names each one's module and class; a module is imported
(and its class registered) when a bundle or a command first asks for that method.
"""
