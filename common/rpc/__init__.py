"""The RPC kit every service and client shares: channel and server options, the one error <-> status mapping,
retries, interceptors, serving in a thread, health probes, bind addresses.
"""
