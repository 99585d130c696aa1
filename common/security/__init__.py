"""Who a caller is and what it may do: mTLS and token credentials, roles, the method table, revocation."""
