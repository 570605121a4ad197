"""A small in-memory inventory with an LRU cache of price lookups.

This file is benchmark data: the code-edit prompt asks the model to return it with one function renamed.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class Item:
    sku: str
    name: str
    price_cents: int
    quantity: int = 0


class LRUCache:
    def __init__(self, capacity: int = 128) -> None:
        self.capacity = capacity
        self._data: OrderedDict[str, int] = OrderedDict()

    def get(self, key: str) -> int | None:
        if key not in self._data:
            return None
        self._data.move_to_end(key)
        return self._data[key]

    def put(self, key: str, value: int) -> None:
        self._data[key] = value
        self._data.move_to_end(key)
        if len(self._data) > self.capacity:
            self._data.popitem(last=False)


class Inventory:
    def __init__(self) -> None:
        self.items: dict[str, Item] = {}
        self.cache = LRUCache(capacity=64)

    def add_item(self, item: Item) -> None:
        self.items[item.sku] = item
        self.cache.put(item.sku, item.price_cents)

    def remove_item(self, sku: str) -> Item:
        item = self.items.pop(sku)
        self.cache.put(sku, 0)
        return item

    def get_price(self, sku: str) -> int:
        cached = self.cache.get(sku)
        if cached is not None:
            return cached
        price = self.items[sku].price_cents
        self.cache.put(sku, price)
        return price

    def total_value(self) -> int:
        return sum(self.get_price(sku) * item.quantity for sku, item in self.items.items())


def restock(inventory: Inventory, sku: str, amount: int) -> None:
    if amount <= 0:
        raise ValueError("amount must be positive")
    inventory.items[sku].quantity += amount
