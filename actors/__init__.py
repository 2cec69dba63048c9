"""The trio actors of one hloserve worker: model queues and the dispatcher."""
