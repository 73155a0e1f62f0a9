"""The test project's URLs: the Django admin (with sdcore's pages) at ``/admin/``."""

from django.contrib import admin
from django.urls import path

urlpatterns = [path("admin/", admin.site.urls)]
