build/obj/daemon/policy/select.o: daemon/policy/select.c \
 daemon/policy/policy.h
daemon/policy/policy.h:
