"""``pdserve bench router-cost``: what the router costs per request and per streamed
token, and whether replicas place alike, against stub engines."""
