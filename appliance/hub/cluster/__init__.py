"""Several hubs, one leader (etcd): the election, the shared state, and the etcd client.

Without `Cluster__Etcd` nothing here is imported and the hub runs alone, as it always did.
"""
