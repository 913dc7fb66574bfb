"""The coordinator: FastAPI app, REST models, checkpoint timer, supervision.

Talks to the runtime only through its control clients; reads storage only to report.
"""
