"""orders: an incremental join of two topics, orders with their customers.

Inputs: ``orders`` ``{"order_id": int, "customer_id": int, "amount": int}`` and ``customers``
``{"customer_id": int, "name": str}`` (a customer record with ``"__weight": -1`` retracts one
sent earlier, e.g. before a rename). Output rows ``{"customer_id", "order_id", "amount",
"name"}``: integrating the output gives exactly the inner join of all orders with all current
customers, whichever side arrived first.
"""

from __future__ import annotations

from pyspark.sql import DataFrame

from sparkstep import Pipeline, join

__all__ = ["pipeline", "transform"]


def transform(orders: DataFrame, customers: DataFrame) -> DataFrame:
    return join(orders, customers, name="orders_customers", on=["customer_id"])


pipeline = Pipeline(
    name="orders",
    inputs={
        "orders": "order_id long, customer_id long, amount long",
        "customers": "customer_id long, name string, __weight int",
    },
    transform=transform,
    output_key=["order_id"],
)
